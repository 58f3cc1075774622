"""What every benchmark under bench/ does around its own scenario: its options, its runs (each
one recorded whatever happens in it, with a line on screen), its results folder and its
markdown tables.

A bench's run is its own dataclass; `execute` needs these fields of it: ok, seconds, reason,
tail, wall_s, load_before, logs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, TypeVar

import psutil

from podagent import __version__ as PODAGENT_VERSION
from tests.harness.cluster import BENCH_PREFIX, read_events
from tests.harness.pods import cleanup_stale, wait_for

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"  # git-ignored

R = TypeVar("R")


@dataclass(kw_only=True)
class RunRecord:
    """What every bench's run carries and `execute` fills in; a bench's own Run subclasses it,
    its own fields first (these are keyword-only)."""
    ok: bool = False
    seconds: float | None = None  # the bench's main figure, shown on its progress line
    reason: str = ""  # why it failed (one line)
    tail: list[str] = field(default_factory=list)  # the last output lines on failure
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    wall_s: float = 0.0  # the whole run, teardown included
    load_before: tuple[float, float, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    logs: str = ""  # the run's log folder, relative to the results
Body = Callable[[R, Path], None]  # a run's scenario: fills the run in, logs in the folder given


class RunFailed(Exception):
    """The scenario failed: a reason in one line and the telling output's last lines."""

    def __init__(self, reason: str, tail: list[str] | None = None):
        super().__init__(reason)
        self.reason, self.tail = reason, tail or []


# --- a program's output -------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def pod_events(run_root: Path) -> Path:
    """The events.jsonl of the pod that writes under `run_root` (a run's directory in that
    pod's log dir: podagent writes in <run>/<its pod id>/); the first one when several do."""
    found = sorted(run_root.glob("*/events.jsonl"))
    return found[0] if found else run_root / "events.jsonl"


def await_event(events: Path, agent: Any, match: Callable[[dict[str, Any]], bool],
                timeout: float, what: str) -> dict[str, Any]:
    """The first event of podagent's events.jsonl that `match` accepts, once it is written.
    RunFailed when the agent's podagent exits first (with its reason) or after `timeout`."""
    def found() -> dict[str, Any] | None:
        for event in read_events(events):
            if match(event):
                return event
        if agent.proc.poll() is not None:
            raise RunFailed(f"{agent.pod.name}'s podagent exited {agent.proc.returncode} "
                            f"instead: {reason_line(agent.output)}", last_lines(agent.output))
        return None

    try:
        return wait_for(found, timeout=timeout, interval=0.05, what=what)
    except TimeoutError as exc:
        raise RunFailed(str(exc), last_lines(agent.output)) from None


def add_run_options(parser: argparse.ArgumentParser, per: str = "method",
                    methods: Iterable[str] | None = None,
                    run_timeout: str = "each bring-up and each wait",
                    timeout: float = 300.0) -> None:
    """The options every bench takes: --runs, --methods (when it has several), --run-timeout
    (`timeout` seconds by default) and --out."""
    parser.add_argument("--runs", type=int, default=3, help=f"runs per {per} (default 3)")
    if methods is not None:
        methods = tuple(methods)
        parser.add_argument("--methods", type=parse_methods(methods), default=list(methods),
                            help=f"{','.join(methods)} (default: all)")
    parser.add_argument("--run-timeout", type=float, default=timeout,
                        help=f"bound on {run_timeout} in seconds (default {timeout:g})")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="results directory (default bench/results/, git-ignored)")


def add_baseline_cap(parser: argparse.ArgumentParser, default: float, wait: str) -> None:
    """--baseline-cap: a plain Ray baseline may never react to a fault, so its wait is bounded
    (`wait` says for what)."""
    parser.add_argument("--baseline-cap", type=float, default=default,
                        help=f"longest wait for {wait}, in seconds (default {default:g})")


def bench_parser(doc: str, **run_options: Any) -> argparse.ArgumentParser:
    """A bench's parser, described by its docstring's first line, with the options every bench
    takes (`run_options` as add_run_options names them): one place for what --help shows."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_run_options(parser, **run_options)
    return parser


def failed_runs(runs: Iterable[Any], label: Callable[[Any], str] = lambda r: r.method,
                what: str = "method") -> list[str]:
    """The report's lines for the runs that failed (none when all succeeded)."""
    rows = [[label(r), str(r.index), r.reason.replace("|", "/")[:300]]
            for r in runs if not r.ok]
    return ["#### Failed runs", "", table([what, "run", "reason"], rows), ""] if rows else []


def join_report(lines: list[str], runs: Iterable[Any],
                label: Callable[[Any], str] = lambda r: r.method, what: str = "method") -> str:
    """A bench's report: its own lines, then the failed runs' table, which every report ends
    with so that a failure is never lost among the figures."""
    return "\n".join([*lines, *failed_runs(runs, label, what)])


def finish(runs: list[Any], outdir: Path, meta: dict[str, Any], args: argparse.Namespace,
           render: Callable[[list[Any], argparse.Namespace, dict[str, Any]], str]) -> int:
    """Writes the report and the results; the bench's exit status: 0 only if every run
    succeeded. The load range covers every run's start and, where a run records it, its end."""
    loads = [x[0] for r in runs for x in (r.load_before, getattr(r, "load_after", None)) if x]
    meta.update(load_min=min(loads, default=0.0), load_max=max(loads, default=0.0))
    write_results(outdir, render(runs, args, meta), meta, args, runs)
    return 0 if runs and all(r.ok for r in runs) else 1


def saved_results(directory: Path) -> dict[str, Any]:
    """DIR/results.json as written, its runs' load averages tuples again (JSON made them lists)
    so that a run rebuilt from its record equals the one measured."""
    saved = json.loads((directory / "results.json").read_text())
    for record in saved["runs"]:
        for key in ("load_before", "load_after"):
            if key in record:
                record[key] = tuple(record[key]) if record[key] else None
    return saved


def rerender(directory: Path, runs: list[Any], saved: dict[str, Any],
             render: Callable[[list[Any], argparse.Namespace, dict[str, Any]], str]) -> int:
    """The report of saved results written again (results.md) and printed."""
    report = render(runs, argparse.Namespace(**saved["args"]), saved["meta"])
    print(report)
    (directory / "results.md").write_text(report + "\n")
    return 0


def last_lines(text: str, count: int = 12) -> list[str]:
    return [ANSI.sub("", line) for line in text.splitlines() if line.strip()][-count:]


def reason_line(text: str) -> str:
    """The most telling line of a failed program's output."""
    lines = [ANSI.sub("", line).strip() for line in text.splitlines() if line.strip()]
    # A program's own verdict first (click's "Error: ...", an exception's last line), then any
    # line that sounds like one; lines Ray forwards from other nodes' raylets come last.
    ranked = (lambda line: line.startswith(("Error:", "ERROR:", "podagent: error")),
              lambda line: re.match(r"^[A-Za-z_.]*(Error|Exception): ", line) is not None,
              lambda line: any(k in line for k in ("Error", "ERROR", "Timed out", "timed out",
                                                   "Failed", "failed", "Check failed")))
    for rank in ranked:
        for line in reversed(lines):
            if rank(line) and not line.startswith("Traceback"):
                return line[:300]
    return lines[-1][:300] if lines else "<no output>"


def foreign_raylets() -> int:
    """Live raylets on this machine before a run starts: other suites' Ray (noise). Zombies
    do not count: the floor's and symmetric-run's daemons are orphans that the machine's init
    reaps a while after the bench killed them."""
    count = 0
    for proc in psutil.process_iter(["name", "status"]):
        if proc.info["name"] == "raylet" and proc.info["status"] != psutil.STATUS_ZOMBIE:
            count += 1
    return count


# --- options ------------------------------------------------------------------------------------


def _numbers(text: str, kind: Callable[[str], Any]) -> list[Any]:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, not {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("expected numbers > 0")
    return values


def parse_ints(text: str) -> list[int]:
    """`1,2,4`: whole numbers >= 1."""
    return _numbers(text, int)


def parse_floats(text: str) -> list[float]:
    """`8,5`: numbers > 0."""
    return _numbers(text, float)


def parse_methods(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An option's type: a comma-separated list of some of `choices`."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        methods = [m.strip() for m in text.split(",") if m.strip()]
        unknown = [m for m in methods if m not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; "
                                             f"choose from {', '.join(choices)}")
        return methods

    return parse


def require_root(parser: argparse.ArgumentParser) -> None:
    if os.geteuid() != 0 or (shutil.which("ip") is None and find_spec("pyroute2") is None):
        parser.error("needs root and iproute2's `ip` or pyroute2 (pods are network namespaces)")


# --- runs ---------------------------------------------------------------------------------------


def begin(out: Path, prefix: str = "", clean: bool = True, net_prefix: str = BENCH_PREFIX
          ) -> tuple[Path, dict[str, Any]]:
    """A bench starts: its results folder out/<prefix><UTC time>/ (with logs/), what a crashed
    earlier bench of its network prefix left removed (never a live one's; not with clean=False,
    for a bench whose pods are not the harness's), and the facts its report starts with."""
    import ray

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    outdir = out.resolve() / f"{prefix}{stamp}"
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    if clean:
        cleanup_stale(prefix=net_prefix)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} CPU(s), {platform.machine()}, "
                       f"{psutil.virtual_memory().total / 2**30:.0f} GiB, "
                       f"Python {platform.python_version()}",
            "ray": ray.__version__, "podagent": PODAGENT_VERSION, "commit": git_commit()}
    print(f"bench: {meta['machine']}; Ray {meta['ray']}; results in {outdir}", flush=True)
    return outdir, meta


def status_line(run: Any, tag: str, figure: str | None = None, note: str = "") -> str:
    """A run's line on screen: `[tag] figure  ok|FAILED: reason  (wall, load<note>)`."""
    if figure is None:
        figure = f"{run.seconds:.2f} s" if run.seconds is not None else "-"
    status = "ok" if run.ok else f"FAILED: {run.reason}"
    return (f"[{tag}] {figure:>9}  {status}  "
            f"(wall {run.wall_s:.0f} s, load {run.load_before[0]:.1f}{note})")


def execute(run: R, outdir: Path, name: str, body: Body[R], line: Callable[[R], str]) -> R:
    """One run, whatever happens in it: body(run, outdir/logs/<name>/); a RunFailed is a failed
    run, any other exception the bench's own failure (recorded too: the next run goes on).
    Then its line and, when it failed, the tail it kept; the run is appended to runs.jsonl."""
    logdir = outdir / "logs" / name
    logdir.mkdir(parents=True, exist_ok=True)
    run.logs = str(logdir.relative_to(outdir))
    run.load_before = os.getloadavg()
    started = time.monotonic()
    try:
        body(run, logdir)
    except RunFailed as exc:
        run.ok, run.reason, run.tail = False, exc.reason, exc.tail
    except Exception as exc:  # the harness itself failed: record it, go on with the next run
        run.ok, run.reason = False, f"bench error: {type(exc).__name__}: {exc}"
    run.wall_s = round(time.monotonic() - started, 1)
    print(line(run), flush=True)
    for tail in run.tail if not run.ok else []:
        print(f"    | {tail}", flush=True)
    with open(outdir / "runs.jsonl", "a") as f:
        f.write(json.dumps(asdict(run)) + "\n")
    return run


def execute_all(plan: Iterable[tuple[R, str, Body[R]]], outdir: Path,
                line: Callable[[R], str]) -> list[R]:
    """execute() each (run, name, body) of the plan in turn; ^C keeps what was measured."""
    runs: list[R] = []
    try:
        for run, name, body in plan:
            runs.append(execute(run, outdir, name, body, line))
    except KeyboardInterrupt:
        print("bench: interrupted; writing what was measured so far", flush=True)
    return runs


def rounds(runs: int, *axes: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """(i, a, b, ...) for every combination of the axes in run i = 1..runs: run 1 of all of
    them before any run 2, so that machine noise spreads evenly over the methods."""
    for i in range(1, runs + 1):
        for combination in itertools.product(*axes):
            yield (i, *combination)


def run_all(parser: argparse.ArgumentParser, argv: list[str] | None, prefix: str,
            plan: Callable[[argparse.Namespace], Iterable[tuple[R, str, Body[R]]]],
            line: Callable[[R, int], str],
            render: Callable[[list[Any], argparse.Namespace, dict[str, Any]], str]) -> int:
    """A bench of pods from its command line to its exit status, for those that need nothing
    between the steps: options parsed, root checked, its results folder out/<prefix><time>/,
    each (run, name, body) of plan(args) executed with line(run, --runs) on screen, and then
    the report and the results written."""
    args = parser.parse_args(argv)
    require_root(parser)
    outdir, meta = begin(args.out, prefix)
    runs = execute_all(plan(args), outdir, lambda r: line(r, args.runs))
    return finish(runs, outdir, meta, args, render)


def git_commit() -> str:
    """This checkout's commit, `+dirty` when podagent/ has uncommitted changes."""
    try:
        proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=False)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                                "podagent"], capture_output=True, text=True, check=False)
    except OSError:  # no git on this machine (a copy of the tree, not a checkout)
        return "?"
    return (proc.stdout.strip() or "?") + ("+dirty" if dirty.stdout.strip() else "")


def write_results(outdir: Path, report: str, meta: dict, args: argparse.Namespace,
                  runs: list) -> None:
    """The table on screen and in results.md; every run's figures in results.json."""
    print("\n" + report, flush=True)
    (outdir / "results.md").write_text(report + "\n")
    (outdir / "results.json").write_text(json.dumps(
        {"meta": meta, "args": {k: (str(v) if isinstance(v, Path) else v)
                                for k, v in vars(args).items()},
         "runs": [asdict(r) for r in runs]}, indent=2) + "\n")
    print(f"\nbench: wrote {outdir / 'results.md'} and {outdir / 'results.json'}", flush=True)


# --- tables -------------------------------------------------------------------------------------


def median(values: list[float], digits: int | None = None) -> float | None:
    """The median (rounded to `digits` when given); None for no values."""
    if not values:
        return None
    value = statistics.median(values)
    return value if digits is None else round(value, digits)


def figures(runs: Iterable[Any], method: str, get: Callable[[Any], float | None]
            ) -> list[float]:
    """`get` of each successful run of `method` that has it: what a table's cell sums up (a
    failed run's partial figures would skew it)."""
    found = [get(r) for r in runs if r.method == method and r.ok]
    return [v for v in found if v is not None]


def median_ratio(base: list[float], ours: list[float]) -> float | None:
    """The baseline's median over ours: how many times faster ours is; None where either side
    has no figures (or ours is 0) and a table shows `-`."""
    return median(base) / median(ours) if base and ours and median(ours) else None


def spread(found: list[float], capped: bool = False, count: bool = True) -> str:
    """A cell `median (min-max; N runs)`, `-` for none; `≥ ` in front where a baseline's wait
    was capped: its true figure is higher."""
    if not found:
        return "-"
    runs = f"; {len(found)} runs" if count else ""
    at_least = "≥ " if capped else ""
    return f"{at_least}{median(found):.1f} ({min(found):.1f}-{max(found):.1f}{runs})"


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
