"""The fault campaign (tests/harness/campaign.py): a head and a worker (network namespaces with a
real DNS server, the real podagent in each) brought to one state of their lifecycle, one fault
injected, the run let go to its end, and the invariants checked: (a) every podagent ends (or
stays, per policy) within the bound, (b) its exit code agrees with the README's table and with
what it recorded, (c) nothing of the run is left in a pod, (d) never two live jobs of the run,
(e) checkpoint, logs and ledger intact.

Prints the table fault x state -> the time from the fault to the last podagent's end and the
verdicts, the worst cell, and the seed; a failing cell runs again exactly with
`--cells NAME --seed SEED`. Needs root and iproute2 (or pyroute2). Run from the repository root
with the project's virtual environment:

    python bench/faults.py --cells all [--seed N] [--jobs K] [--podagent DIR] [--out DIR]

--cells: `all` (every fault at every state, of a Ray run and of a run without Ray), `ray` or
`gang` (one of the two), `sample` (what CI runs: every fault and every state at least once), or
cell names as the run prints them (fault[-variant]@state[:target]; what a
name leaves open, the seed picks). --jobs runs cells side by side (each on a network of its
own); keep it at 1 on two cores. --podagent runs another checkout's podagent (its directory
goes first on PYTHONPATH), for a before-and-after comparison with the same harness and seed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import campaign
from tests.harness.benchkit import git_commit, require_root, table
from tests.harness.pods import cleanup_stale

DEFAULT_SEED = 2126


def pick(spec: str, seed: int) -> list[campaign.Cell]:
    if spec == "all":
        return campaign.matrix(seed)
    if spec in ("ray", "gang"):  # one lifecycle's matrix
        return campaign.matrix(seed, campaign.STATES if spec == "ray" else campaign.GANG_STATES)
    if spec == "sample":
        return campaign.sample(seed)
    try:
        return [campaign.parse(name.strip(), seed) for name in spec.split(",") if name.strip()]
    except ValueError as exc:
        raise SystemExit(f"--cells: {exc}") from None


def render(results: list[campaign.CellResult], seed: int, when: str) -> str:
    """fault x state -> 'seconds verdict' (ok, or the invariants that broke)."""
    by = {(r.cell.fault, r.cell.state): r for r in results}
    tables = []
    for title, all_states in (("A Ray run", campaign.STATES),
                              ("A run without Ray (`podagent torchrun`)", campaign.GANG_STATES)):
        catalogue = campaign.catalogue(all_states[0])
        faults = [f for f in catalogue if any(k[0] == f and k[1] in all_states for k in by)]
        states = [s for s in all_states if any(k[1] == s for k in by)]
        if not states:
            continue
        rows = []
        for fault in faults:
            row = [fault]
            for state in states:
                r = by.get((fault, state))
                if r is None:
                    row.append("" if campaign.targets(fault, state) else "n/a")
                    continue
                end = f"{r.fault_to_end:.0f} s" if r.fault_to_end is not None else "-"
                if r.error:
                    row.append(f"{end} ERROR")
                elif r.held:
                    row.append(f"{end} ok")
                else:
                    broken = "".join(k for k, ok in r.verdicts().items() if not ok)
                    row.append(f"{end} **{broken}**")
            rows.append(row)
        tables += [f"{title}:", "", table(["fault \\ state", *states], rows), ""]
    held = sum(r.held for r in results)
    succeeded = sum(r.run_outcome == "succeeded" for r in results)
    worst = max((r for r in results if r.fault_to_end is not None),
                key=lambda r: r.fault_to_end or 0, default=None)
    lines = [*tables,
             f"{held} of {len(results)} cells held every invariant (seed {seed}, {when}, "
             f"commit {git_commit()}); n/a: nothing of the fault's kind runs in that state.",
             f"In {succeeded} of them the run went on to its job's success (the others ended "
             f"as the fault left them: a stopped pod, a head gone for good)."]
    if worst:
        lines.append(f"Worst cell: {worst.cell.name}, {worst.fault_to_end:.0f} s from the fault "
                     f"to the last podagent's end.")
    for r in results:
        if not r.held:
            lines.append(f"- {r.cell.name}: " + "; ".join(
                ([r.error] if r.error else []) + r.violations))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="sample")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--podagent", default=None,
                        help="a checkout whose podagent runs in the pods (PYTHONPATH)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/faults"))
    parser.add_argument("--skip", type=Path, default=None, metavar="RESULTS",
                        help="leave out the cells of an earlier run's results.json (a run cut "
                             "short goes on where it stopped)")
    parser.add_argument("--render", type=Path, nargs="+", default=None, metavar="RESULTS",
                        help="print the report of saved results.json files (merged), run "
                             "nothing")
    args = parser.parse_args()
    if args.render:
        saved = [campaign.CellResult.from_json(r) for path in args.render
                 for r in json.loads(path.read_text())]
        order = {c.name: i for i, c in enumerate(campaign.matrix(args.seed))}
        saved.sort(key=lambda r: order.get(r.cell.name, len(order)))
        print(render(saved, args.seed, "saved results"))
        return 0 if all(r.held for r in saved) else 1
    require_root(parser)
    cleanup_stale(campaign.CAMPAIGN_PREFIX)
    cells = pick(args.cells, args.seed)
    if args.skip:
        done = {r["name"] for r in json.loads(args.skip.read_text())}
        cells = [c for c in cells if c.name not in done]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    outdir = args.out / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    outdir.mkdir(parents=True, exist_ok=True)
    podagent = str(Path(args.podagent).resolve()) if args.podagent else None
    print(f"{len(cells)} cell(s), seed {args.seed}, {args.jobs} at a time; results in {outdir}",
          flush=True)

    done: list[campaign.CellResult] = []
    lock = threading.Lock()

    def save() -> None:
        """After every cell: a run cut short keeps what it found."""
        with lock:
            ordered = sorted(done, key=lambda r: cells.index(r.cell))
            (outdir / "report.md").write_text(render(ordered, args.seed, started) + "\n")
            (outdir / "results.json").write_text(json.dumps(
                [r.to_json() for r in ordered], indent=1, default=str))

    def one(index_cell: tuple[int, campaign.Cell]) -> campaign.CellResult:
        index, cell = index_cell
        root = outdir / f"{index:03d}-{cell.name.replace(':', '-').replace('@', '-at-')}"
        result = campaign.run_cell(cell, root, podagent, say=print if args.jobs == 1 else
                                   (lambda line: None))
        verdict = "held" if result.held else "BROKE: " + "; ".join(
            ([result.error] if result.error else []) + result.violations)
        print(f"[{index + 1}/{len(cells)}] {cell.name}: {verdict} (state {result.state_seen}, "
              f"fault->end {result.fault_to_end} s, cell {result.took} s)", flush=True)
        (root / "result.json").write_text(json.dumps(result.to_json(), indent=1, default=str))
        with lock:
            done.append(result)
        save()
        return result

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(one, enumerate(cells)))
    print("\n" + render(results, args.seed, started))
    return 0 if all(r.held for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
