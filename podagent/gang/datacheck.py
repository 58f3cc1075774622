"""Catch ranks that see the same samples: a data loader that is not split over the run.

Two sides. On the pods this file is the training script under the launcher (torchrun or
accelerate launch): every rank takes a few batches from the loader, cuts them into samples,
and writes a digest of each to DIR/rank-<RANK>.json. That side imports only the standard
library and torch (and accelerate in accelerate mode), never podagent, so that it runs in the
training image as it is. In podagent's own process: read the rank files and judge them.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__)
MODES = ("torchrun", "accelerate")
DEFAULT_BATCHES = 16
DEFAULT_BATCHES_PER_RANK = 4  # the default loader: four batches of four for every rank, so no
DEFAULT_BATCH_SIZE = 4  # sampler pads (padding repeats samples on purpose)
DIGEST_BYTES = 8
REPORT_GLOB = "rank-*.json"
# Digests one pod sends the head, at most (about 300 KB): past it every rank keeps the same
# consistent sample of them, so one line carries any batch (the supervisor port's limit).
SENT_DIGESTS = 16384


# --- podagent's side -------------------------------------------------------------------------

def script_args(out_dir: Path, mode: str, loader: str | None) -> tuple[str, ...]:
    """The check's command line after the launcher's own arguments."""
    extra = ("--loader", loader) if loader else ()
    return (str(SCRIPT), "--out", str(out_dir), "--mode", mode, *extra)


def _bound(node: ast.stmt) -> list[str]:
    """The names a top-level statement binds (def, class, assignment, import)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [t.id for t in targets if isinstance(t, ast.Name)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [a.asname or a.name.split(".")[0] for a in node.names]
    return []


def _defines(tree: ast.Module, name: str) -> bool:
    return any(name in _bound(node) for node in tree.body)


def check_loader_spec(spec: str) -> str:
    """FILE:FUNC, checked before anything starts: FILE exists and parses and defines FUNC at
    its top level. Returns the spec with FILE made absolute (the launcher's processes load it
    from wherever they run)."""
    from podagent.errors import ConfigError

    file, _, func = spec.rpartition(":")
    if not file or not func.isidentifier():
        raise ConfigError("--loader", spec, "must be FILE:FUNC, e.g. train.py:build_loader")
    path = Path(file)
    try:
        source = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("--loader", spec, f"names {file}, which does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--loader", spec, f"names {file}, which cannot be read: "
                          f"{getattr(exc, 'strerror', None) or exc.__class__.__name__}") from None
    try:
        tree = ast.parse(source, filename=file)
    except SyntaxError as exc:
        raise ConfigError("--loader", spec, f"names {file}, which does not parse: {exc.msg} at "
                          f"line {exc.lineno}") from None
    if not _defines(tree, func):
        raise ConfigError("--loader", spec, f"names {func}, which {file} does not define at its "
                          "top level")
    return f"{path.resolve()}:{func}"


def read_reports(out_dir: Path, pod: str) -> list[dict]:
    """The rank files one pod wrote, each marked with the pod; unreadable ones (and those
    without an integer rank) are skipped."""
    reports = []
    for path in sorted(Path(out_dir).glob(REPORT_GLOB)):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(report, dict) and isinstance(report.get("rank"), int):
            reports.append({**report, "pod": pod})
    return reports


@dataclass(frozen=True)
class Verdict:
    ok: bool
    line: str  # one line with the numbers
    figures: Mapping[str, object]


def _who(report: Mapping) -> str:
    return f"{report['rank']} (pod {report['pod']})"


def _ranks_reported_twice(reports: Sequence[Mapping]) -> Verdict | None:
    pods: dict[int, list[str]] = {}
    for report in reports:
        pods.setdefault(report["rank"], []).append(str(report["pod"]))
    twice = {rank: names for rank, names in sorted(pods.items()) if len(names) > 1}
    if not twice:
        return None
    rank, names = next(iter(twice.items()))
    worlds = sorted({r.get("world") for r in reports}, key=str)
    line = (f"data check: the nodes did not form one run: rank {rank} was reported by "
            f"{len(names)} pods ({', '.join(names)}), {len(twice)} ranks reported more than once; "
            f"each node ran its own world (WORLD_SIZE {'/'.join(map(str, worlds))})")
    return Verdict(False, line, {"duplicated_ranks": sorted(twice), "worlds": worlds,
                                 "reports": len(reports)})


def _ranks_missing(reports: Sequence[Mapping], expected_world: int) -> Verdict | None:
    seen = {r["rank"] for r in reports}
    worlds = sorted({r.get("world") for r in reports if r.get("world") != expected_world},
                    key=str)
    if worlds:
        return Verdict(False, f"data check: ranks report WORLD_SIZE {'/'.join(map(str, worlds))}, "
                       f"expected {expected_world}", {"worlds": worlds, "expected": expected_world})
    missing = [rank for rank in range(expected_world) if rank not in seen]
    if not missing:
        return None
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    line = (f"data check: {len(seen)} of {expected_world} ranks reported: rank(s) {shown} wrote "
            "no report")
    return Verdict(False, line, {"reported": len(seen), "expected": expected_world,
                                 "missing": missing})


def _accelerate_apart(reports: Sequence[Mapping]) -> Verdict | None:
    apart = [r for r in reports if "accelerate_processes" in r
             and r["accelerate_processes"] != r.get("world")]
    if not apart:
        return None
    first = apart[0]
    seen, mode = first["accelerate_processes"], first.get("accelerate_mode")
    line = (f"data check: accelerate saw {seen} process(es) on {len(apart)} of {len(reports)} "
            f"ranks where WORLD_SIZE is {first.get('world')} (distributed type {mode}, rank "
            f"{_who(first)})")
    if seen == 1:
        line += ("; each process trained alone: on pods without GPUs its processes need "
                 "ACCELERATE_USE_CPU=true")
    return Verdict(False, line, {"ranks_apart": len(apart), "accelerate_processes": seen,
                                 "accelerate_mode": mode})


def _overlap(reports: Sequence[Mapping], cut: float = 1.0) -> Verdict:
    """Whether two ranks saw one sample. Below a cut (reports sent compact) the digests are a
    consistent sample of the samples: the counts are estimates of the whole, and say so."""
    ranks = {(str(r["pod"]), r["rank"]): set(r.get("samples", ())) for r in reports}
    sampled = sum(len(r.get("samples", ())) for r in reports)
    total = sum(int(r.get("count", len(r.get("samples", ())))) for r in reports)
    holders: dict[str, int] = {}
    for digests in ranks.values():
        for digest in digests:
            holders[digest] = holders.get(digest, 0) + 1
    padding = _padding(reports, holders)
    shared = sum(1 for r in reports for d in r.get("samples", ())
                 if holders[d] > 1 and d not in padding)

    def whole(n: int) -> int:
        return n if cut >= 1.0 else round(n / cut)

    about, sample_note = ("", "") if cut >= 1.0 else (
        "about ", f" (judged on a consistent sample of {sampled} of their digests)")
    pods = len({key[0] for key in ranks})
    figures: dict[str, object] = {"ranks": len(ranks), "pods": pods, "samples": total,
                                  "shared": whole(shared), "padding": whole(len(padding))}
    if cut < 1.0:
        figures.update(sampled=sampled, cut=cut)
    if total == 0:
        return Verdict(False, f"data check: {len(ranks)} ranks saw no sample", figures)
    if shared == 0:
        padded = (f" (besides {about}{whole(len(padding))} repeated in the last batch: a "
                  f"sampler's padding)" if padding else "")
        return Verdict(True, f"data check: {len(ranks)} ranks over {pods} pod"
                       f"{'' if pods == 1 else 's'}, {total} samples, none seen by two "
                       f"ranks{padded}{sample_note}", figures)
    (a, b), common, of = _worst_pair(ranks)
    figures.update(worst_pair=[list(a), list(b)], pair_shared=whole(common), pair_of=whole(of))
    line = (f"data check: {len(ranks)} ranks saw {total} samples, {about}{whole(shared)} of "
            f"them on more than one rank; ranks {a[1]} (pod {a[0]}) and {b[1]} (pod {b[0]}) "
            f"share {about}{whole(common)} of {whole(of)} samples{sample_note}")
    return Verdict(False, line, figures)


def _padding(reports: Sequence[Mapping], holders: Mapping[str, int]) -> set[str]:
    """Samples seen by several ranks only because a sampler evened the ranks out: every
    occurrence but one is in the last batch of a rank whose loader ended (DistributedSampler
    and accelerate's even batches repeat the first samples there)."""
    in_tail: dict[str, int] = {}
    for r in reports:
        samples, tail = list(r.get("samples", ())), int(r.get("tail") or 0)
        for d in samples[len(samples) - tail:] if tail else ():
            in_tail[d] = in_tail.get(d, 0) + 1
    return {d for d, n in holders.items() if n > 1 and n - in_tail.get(d, 0) == 1}


def _worst_pair(ranks: Mapping[tuple[str, int], set[str]]):
    """The two ranks sharing the most samples: (pair, shared, the smaller one's count)."""
    best = None
    for a, b in combinations(sorted(ranks), 2):
        common = len(ranks[a] & ranks[b])
        if best is None or common > best[1]:
            best = ((a, b), common, min(len(ranks[a]), len(ranks[b])))
    return best


def judge(reports: Sequence[Mapping], expected_world: int) -> Verdict:
    """Whether the ranks of one run saw disjoint samples, with the numbers in one line."""
    for check in (_ranks_reported_twice, lambda r: _ranks_missing(r, expected_world),
                  _accelerate_apart):
        verdict = check(reports)
        if verdict is not None:
            return verdict
    cut = min((float(r.get("cut", 1.0)) for r in reports), default=1.0)
    return _overlap([_below(r, cut) for r in reports] if cut < 1.0 else reports, cut)


def _place(digest_text: str) -> float:
    """Where a digest falls in [0, 1): the same on every rank, spread evenly."""
    return int.from_bytes(hashlib.blake2b(digest_text.encode(), digest_size=4).digest(),
                          "big") / 2**32


def compact(reports: Sequence[Mapping], limit: int = SENT_DIGESTS) -> list[dict]:
    """A pod's reports made small enough to send whatever the batches: past `limit` digests in
    all, every rank keeps only those placed below one cut (a consistent sample: what two ranks
    share stays shared in it), with its true count and the cut."""
    total = sum(len(r.get("samples", ())) for r in reports)
    if total <= limit:
        return [dict(r) for r in reports]
    return [_below(r, limit / total) for r in reports]


def _below(report: Mapping, cut: float) -> dict:
    samples = list(report.get("samples", ()))
    tail = int(report.get("tail") or 0)
    start = len(samples) - tail if tail else len(samples)
    kept = [(i, d) for i, d in enumerate(samples) if _place(d) < cut]
    return {**report, "samples": [d for _, d in kept], "cut": cut,
            "count": int(report.get("count", len(samples))),
            "tail": sum(1 for i, _ in kept if i >= start)}


# --- the pods' side: standard library and torch only -----------------------------------------

@dataclass(frozen=True)
class Identity:
    rank: int
    world: int
    node: int | None
    local_rank: int


def identity(env: Mapping[str, str]) -> Identity:
    """This process's place in the run, as the launcher put it in the environment."""
    node = env.get("GROUP_RANK")
    return Identity(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")),
                    int(node) if node not in (None, "") else None, int(env.get("LOCAL_RANK", "0")))


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _rows(columns: Sequence[list]) -> list[tuple]:
    """Columns zipped into rows; a column of one (a value for the whole batch) goes with
    every row."""
    if not columns:
        return []
    size = max(len(column) for column in columns)
    widened = [column * size if len(column) == 1 else column for column in columns]
    return list(zip(*widened, strict=False))  # a short column ends the rows


def samples_of(batch: Any) -> list:
    """A batch cut into samples: a tensor's rows along dim 0; a dict's or a sequence's parts
    zipped row by row; a sequence of plain values (numbers, strings) one sample each; anything
    else one sample."""
    if _is_tensor(batch):
        return [batch] if batch.dim() == 0 else list(batch.unbind(0))
    if isinstance(batch, Mapping):
        keys = list(batch)
        rows = _rows([samples_of(batch[key]) for key in keys])
        return [dict(zip(keys, row, strict=True)) for row in rows]
    if isinstance(batch, (list, tuple)):
        if any(_is_tensor(part) or isinstance(part, (Mapping, list, tuple)) for part in batch):
            return _rows([samples_of(part) for part in batch])
        return list(batch)
    return [batch]


def _encode(sample: Any) -> bytes:
    """One canonical byte string per sample: equal samples on two ranks give equal bytes."""
    if _is_tensor(sample):
        import torch

        flat = sample.detach().cpu().contiguous().reshape(-1)
        raw = bytes(flat.view(torch.uint8).clone().untyped_storage()) if flat.numel() else b""
        return f"tensor:{sample.dtype}:{tuple(sample.shape)}:".encode() + raw
    if isinstance(sample, Mapping):
        return b"{" + b"".join(repr(k).encode() + b"=" + _encode(v) + b";"
                               for k, v in sample.items()) + b"}"
    if isinstance(sample, (list, tuple)):
        return b"(" + b"".join(_encode(part) + b";" for part in sample) + b")"
    return b"repr:" + repr(sample).encode()


def digest(sample: Any) -> str:
    return hashlib.blake2b(_encode(sample), digest_size=DIGEST_BYTES).hexdigest()


def take(loader: Iterable, batches: int) -> tuple[list[str], int, int]:
    """The digests of the samples in the loader's first batches, how many batches, and how
    many samples its last batch held when the loader ended within them (0 when cut short):
    where a sampler's padding is."""
    digests: list[str] = []
    taken = last = 0
    for batch in loader:
        if taken >= batches:
            return digests, taken, 0
        samples = [digest(sample) for sample in samples_of(batch)]
        digests.extend(samples)
        taken, last = taken + 1, len(samples)
    return digests, taken, last


def _user_loader(spec: str) -> Iterable:
    """FILE:FUNC: FILE loaded as a module (its folder importable, as when run as a script),
    FUNC() called for the loader."""
    file, _, func = spec.rpartition(":")
    path = Path(file).resolve()
    sys.path.insert(0, str(path.parent))
    module_spec = importlib.util.spec_from_file_location(f"datacheck_loader_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {file} as a module")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, func)()


def _default_loader(mode: str, who: Identity, accelerator: Any) -> Iterable:
    from torch.utils.data import DataLoader, DistributedSampler

    data = range(DEFAULT_BATCH_SIZE * DEFAULT_BATCHES_PER_RANK * who.world)
    if mode == "accelerate":
        return accelerator.prepare(DataLoader(data, batch_size=DEFAULT_BATCH_SIZE))
    sampler = DistributedSampler(data, num_replicas=who.world, rank=who.rank, shuffle=False)
    return DataLoader(data, batch_size=DEFAULT_BATCH_SIZE, sampler=sampler)


def _write_atomic(path: Path, report: Mapping) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report), encoding="utf-8")
    os.replace(tmp, path)


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="podagent's data check, run on every rank")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--loader", help="FILE:FUNC; FUNC() returns the iterable of batches")
    parser.add_argument("--batches", type=int, default=DEFAULT_BATCHES)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _arguments(argv)
    who = identity(os.environ)
    import torch  # noqa: F401  (samples are told apart from tensors through it)

    report: dict[str, Any] = {"rank": who.rank, "world": who.world, "node": who.node,
                              "local_rank": who.local_rank}
    accelerator = None
    if args.mode == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator()
        report["accelerate_processes"] = accelerator.num_processes
        report["accelerate_mode"] = str(accelerator.distributed_type)
    loader = (_user_loader(args.loader) if args.loader
              else _default_loader(args.mode, who, accelerator))
    report["samples"], report["batches"], report["tail"] = take(loader, args.batches)
    _write_atomic(args.out / f"rank-{who.rank}.json", report)
    return 0


if __name__ == "__main__":
    # Run as a script, this file's folder comes first on sys.path, and podagent's own
    # accelerate.py beside it would hide the accelerate package.
    here = SCRIPT.resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.exit(main())
