"""benchkit: what the benchmarks under bench/ share (run order, table cells, ratios, reports,
saved results)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import pytest

from tests.harness import benchkit


@dataclass(kw_only=True)
class Run(benchkit.RunRecord):
    method: str
    index: int = 1
    load_after: tuple[float, float, float] | None = None


def test_rounds_give_run_1_of_every_combination_before_run_2():
    assert list(benchkit.rounds(2, ["a", "b"])) == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert list(benchkit.rounds(1, ["kill", "cut"], ["x", "y"])) == [
        (1, "kill", "x"), (1, "kill", "y"), (1, "cut", "x"), (1, "cut", "y")]
    assert list(benchkit.rounds(0, ["a"])) == []


def test_figures_are_the_methods_successful_runs_that_have_one():
    runs = [Run(method="a", ok=True, seconds=1.0), Run(method="a", ok=False, seconds=9.0),
            Run(method="a", ok=True, seconds=None), Run(method="b", ok=True, seconds=5.0),
            Run(method="a", ok=True, seconds=3.0)]
    assert benchkit.figures(runs, "a", lambda r: r.seconds) == [1.0, 3.0]
    assert benchkit.figures(runs, "c", lambda r: r.seconds) == []


def test_spread_shows_median_range_and_count():
    assert benchkit.spread([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0; 3 runs)"
    assert benchkit.spread([1.25, 2.0], capped=True) == "≥ 1.6 (1.2-2.0; 2 runs)"
    assert benchkit.spread([4.0], count=False) == "4.0 (4.0-4.0)"
    assert benchkit.spread([]) == "-"


def test_median_ratio_is_the_baselines_median_over_ours():
    assert benchkit.median_ratio([4.0, 6.0, 8.0], [2.0, 3.0]) == pytest.approx(6.0 / 2.5)
    assert benchkit.median_ratio([], [1.0]) is None
    assert benchkit.median_ratio([1.0], []) is None
    assert benchkit.median_ratio([1.0], [0.0, 0.0]) is None  # no ratio to a zero


def test_join_report_ends_with_the_failed_runs():
    runs = [Run(method="a", ok=True), Run(method="b", index=2, ok=False, reason="cut | off")]
    text = benchkit.join_report(["### Title", ""], runs)
    assert text.startswith("### Title\n\n#### Failed runs\n")
    assert "| method | run | reason |" in text and "| b | 2 | cut / off |" in text
    assert benchkit.join_report(["x", "y"], runs[:1]) == "x\ny"
    assert "| K | run | reason |" in benchkit.join_report([], runs, label=lambda r: "4", what="K")


def test_bench_parser_has_the_common_options_and_says_its_defaults():
    parser = benchkit.bench_parser("Title line.\n\nMore.", per="method and N",
                                   methods=("x", "y"), run_timeout="each run", timeout=240.0)
    benchkit.add_baseline_cap(parser, 120.0, "plain Ray to react")
    args = parser.parse_args([])
    assert (args.runs, args.methods, args.run_timeout, args.baseline_cap) == (
        3, ["x", "y"], 240.0, 120.0)
    assert args.out == benchkit.RESULTS
    text = " ".join(parser.format_help().split())
    assert parser.description == "Title line."
    for phrase in ("runs per method and N (default 3)", "x,y (default: all)",
                   "bound on each run in seconds (default 240)",
                   "longest wait for plain Ray to react, in seconds (default 120)"):
        assert phrase in text
    assert parser.parse_args(["--methods", "y", "--runs", "1"]).methods == ["y"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--methods", "z"])


def test_finish_writes_the_report_and_counts_every_load(tmp_path, capsys):
    runs = [Run(method="a", ok=True, seconds=1.0, load_before=(0.5, 0, 0),
                load_after=(2.5, 0, 0)),
            Run(method="b", ok=True, seconds=2.0, load_before=(1.0, 0, 0))]
    meta = {"started": "then"}
    args = argparse.Namespace(runs=1, out=tmp_path)

    def render(rs, a, m):
        return f"{len(rs)} runs, load {m['load_min']}-{m['load_max']}"

    assert benchkit.finish(runs, tmp_path, meta, args, render) == 0
    assert (meta["load_min"], meta["load_max"]) == (0.5, 2.5)
    assert (tmp_path / "results.md").read_text() == "2 runs, load 0.5-2.5\n"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["args"] == {"runs": 1, "out": str(tmp_path)}
    assert [r["method"] for r in saved["runs"]] == ["a", "b"]
    assert "2 runs, load 0.5-2.5" in capsys.readouterr().out

    runs[1].ok = False
    assert benchkit.finish(runs, tmp_path, {}, args, render) == 1
    assert benchkit.finish([], tmp_path, {}, args, render) == 1


def test_saved_results_rebuild_the_runs_as_measured(tmp_path):
    runs = [Run(method="a", ok=True, seconds=1.5, load_before=(0.1, 0.2, 0.3),
                load_after=(0.4, 0.5, 0.6), extra={"k": [1, 2]}),
            Run(method="b", ok=False, reason="no", load_before=None)]
    benchkit.write_results(tmp_path, "report", {"m": 1}, argparse.Namespace(runs=1), runs)
    saved = benchkit.saved_results(tmp_path)
    assert [Run(**record) for record in saved["runs"]] == runs
    assert saved["meta"] == {"m": 1} and saved["args"] == {"runs": 1}
