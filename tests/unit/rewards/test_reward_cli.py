"""`python -m podagent.rewards`: bad settings exit 2 with one line naming what to fix."""

from __future__ import annotations

import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from podagent.rewards import settings
from podagent.rewards.cli import reward_server

from .conftest import clean_env

# (arguments, environment, what the one line must say)
BAD = {
    "port-flag": (["--port", "http"], {},
                  "--port='http' must be a TCP port number from 1 to 65535"),
    "port-env": ([], {"PODAGENT_REWARD_PORT": "70000"},
                 "PODAGENT_REWARD_PORT='70000' must be a TCP port number"),
    "workers-zero": (["--workers", "0"], {}, "--workers='0' must be a whole number >= 1"),
    "timeout-nan": (["--item-timeout", "nan"], {}, "--item-timeout='nan' must be a number >= 0.1"),
    "weight-env": ([], {"PODAGENT_REWARD_FORMAT_WEIGHT": "-1"},
                   "PODAGENT_REWARD_FORMAT_WEIGHT='-1' must be a number >= 0"),
    "max-body": (["--max-body", "16MB"], {}, "--max-body='16MB' must be a size in bytes"),
    "max-items": (["--max-items", "lots"], {}, "--max-items='lots' must be a whole number"),
    "host": (["--host", "not a host!"], {}, "--host='not a host!' must be an IP address"),
    "dataset-missing": (["--dataset", "no-such.jsonl"], {},
                        "--dataset='no-such.jsonl' must be an existing JSONL file"),
    "scoring": (["--scoring", "exact"], {},
                "--scoring='exact' must be one of openrlhf-m, boxed"),
    "template-env": ([], {"PODAGENT_REWARD_TEMPLATE": "llama3"},
                     "PODAGENT_REWARD_TEMPLATE='llama3' must be one of chatml, qwen1, base"),
    "strict": (["--strict", "yes"], {}, "--strict='yes' must be 0 or 1"),
}


def _run(args: list[str], env: dict[str, str], cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podagent.rewards", *args],
                          env=clean_env(**env), capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=cwd)


@pytest.fixture(scope="module")
def bad_runs() -> dict[str, subprocess.CompletedProcess]:
    """Every bad case as a real process, concurrently (each pays a Python start)."""
    with ThreadPoolExecutor(4) as pool:
        futures = {name: pool.submit(_run, args, env) for name, (args, env, _) in BAD.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_setting_exits_2_with_one_line(bad_runs, case):
    result = bad_runs[case]
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("podagent reward-server: error: ")
    assert BAD[case][2] in lines[0]


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "a", "answer": "1"}\nnot json\n', "line 2 is not JSON"),
    ('{"prompt": "a"}\n', "line 1 has no string or number 'answer' (--answer-key)"),
    ('{"question": "a", "answer": "1"}\n', "line 1 has no string 'prompt' (--prompt-key)"),
    ("\n\n", "has no records"),
])
def test_bad_dataset_names_the_line(tmp_path, content, message):
    path = tmp_path / "golds.jsonl"
    path.write_text(content)
    result = CliRunner().invoke(reward_server, ["--dataset", str(path)], env=clean_env())
    assert result.exit_code == 2
    [line] = result.output.splitlines()
    assert f"--dataset='{path}' must be a JSONL file of 'prompt' and 'answer' records" in line
    assert message in line


def test_a_taken_port_is_one_line_and_exit_9():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _run(["--port", str(port), "--workers", "1"], {})
    assert result.returncode == 9
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [f"podagent reward-server: error: port {port} on 127.0.0.1 is already in "
                      "use (holder not visible from here)"]
    assert "Traceback" not in result.stderr


def test_flags_win_over_the_environment_and_both_over_defaults():
    env = {"PODAGENT_REWARD_PORT": "6001", "PODAGENT_REWARD_WORKERS": "3"}
    built = settings.build({"port": "6002"}, env)
    assert (built.port, built.workers, built.host, built.max_body) == (6002, 3, "127.0.0.1",
                                                                       64 << 20)
    assert built.source_name("port") == "--port"
    assert built.source_name("workers") == "PODAGENT_REWARD_WORKERS"
    assert settings.build({}, {}).workers == settings.cpu_count()


def test_the_readme_has_the_settings_table():
    readme = Path(__file__).resolve().parents[3] / "README.md"
    assert settings.settings_table() in readme.read_text(encoding="utf-8"), \
        "regenerate with: python -m podagent.rewards.settings"


def test_the_profile_settings_and_their_defaults():
    built = settings.build({}, {})
    assert (built.scoring, built.template, built.strict) == ("openrlhf-m", "chatml", False)
    built = settings.build({"template": "base"}, {"PODAGENT_REWARD_SCORING": "boxed",
                                                  "PODAGENT_REWARD_STRICT": "1"})
    assert (built.scoring, built.template, built.strict) == ("boxed", "base", True)
    assert built.source_name("template") == "--prompt-template"


def test_help_documents_the_reward_formula_and_every_variable():
    """--help shows the formula and the settings a first use needs; `podagent help settings
    reward-server`, where it points, every one."""
    from podagent import cli
    from podagent.config.fields import REWARD_FIRST

    result = CliRunner().invoke(reward_server, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "reward = accuracy + FORMAT_WEIGHT x format" in text
    assert "podagent help settings reward-server" in text
    every = " ".join(cli.settings_help("reward-server").split())
    for field in settings.FIELDS:
        assert field.flag in every and field.env in every
        assert (field.env in text) == (field.attr in REWARD_FIRST)
