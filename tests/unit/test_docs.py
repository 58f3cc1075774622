"""The README's tables are generated from the code, and CI runs the README's test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from podagent import cli, config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_settings_table_matches_the_code():
    assert config.settings_table() in README, "regenerate with: python -m podagent.config"


def test_readme_exit_code_table_matches_the_code():
    assert cli.exit_code_table() in README


def test_every_setting_is_in_the_readme_with_flag_and_variable():
    for field in config.FIELDS:
        assert f"`{field.flag}` | `{field.env}`" in README


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    test_command = next(line for line in ci_lines if "pytest" in line)
    assert f"\n{test_command}\n" in README


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
