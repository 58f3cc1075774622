"""The README's tables are generated from the code, CI runs the README's test command, and every
relative link of the README and docs/ resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from podagent.config.fields import FIELDS, first_run_table, settings_page
from podagent.run import exits

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_settings_tables_match_the_code():
    """docs/settings.md holds every setting, one table per group; the README the first run's."""
    page = (ROOT / "docs" / "settings.md").read_text()
    assert settings_page() in page, "regenerate with: python -m podagent.config"
    assert first_run_table() in README, "regenerate with: python -m podagent.config"


def test_up_options_table_matches_the_code():
    from podagent.launch import options

    assert options.markdown_table() in (ROOT / "docs" / "up.md").read_text(), \
        "regenerate with: python -m podagent.launch.options"


def test_readme_exit_code_table_matches_the_code():
    assert exits.table() in README


def test_every_setting_is_documented_with_flag_and_variable():
    page = (ROOT / "docs" / "settings.md").read_text()
    for field in FIELDS:
        assert f"`{field.flag}` | `{field.env}`" in page


def test_the_readme_fits_its_budget():
    assert len(README.encode()) <= 25_600


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    test_command = next(line for line in ci_lines if "pytest" in line)
    assert f"\n{test_command}\n" in README


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- links: every relative link in the README and docs/ points at a file (and heading) that exists

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", re.MULTILINE)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (where brackets are code, not links)."""
    return FENCE.sub("", text)


def _anchors(text: str) -> set[str]:
    """The anchors GitHub makes of the headings: lower case, punctuation dropped, spaces to
    hyphens; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(_prose(text)):
        heading = LINK.sub(lambda m: m.group(0)[1:m.group(0).index("]")], heading)
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(_prose(doc.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_page_of_docs_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve()
              for target in LINK.findall(_prose(README))}
    assert [p.name for p in DOCS[1:] if p.resolve() not in linked] == []


def _to_add_rows() -> list[tuple[str, str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## To add X, change Y", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return [(r[0].lstrip("| "), r[1], r[2].rstrip(" |")) for r in rows[2:]]  # past the header


def test_the_to_add_table_names_real_files_and_counts_them():
    """docs/architecture.md's "To add X, change Y": every path a row names exists, and the
    files column counts them (`N`: exactly; `N or M` / `N to M`: at least the fewest; `+ K`:
    files the row names without a path)."""
    rows = _to_add_rows()
    assert {"an asking command", "a state of the head", "a reward server setting",
            "a launcher (beside torchrun and accelerate)"} <= {r[0] for r in rows}
    for what, change, files in rows:
        named = set(re.findall(r"podagent/[\w/]+\.py", change))
        missing = [p for p in named if not (ROOT / p).is_file()]
        assert not missing, f"{what}: no such file {missing}"
        count = re.fullmatch(r"(\d+)?(?: (?:or|to) (\d+))?(?: ?\+ ?(\d+))?", files.strip())
        assert count, f"{what}: files column {files!r}"
        fewest, most = int(count.group(1) or 0), count.group(2)
        if most is None:
            assert len(named) == fewest, f"{what}: names {sorted(named)}, says {files}"
        else:
            assert len(named) >= fewest, f"{what}: names {sorted(named)}, says {files}"
