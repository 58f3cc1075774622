"""The data check: batches cut into samples, the verdict on hand-made rank reports, and three
real runs of the check script under torch's launcher and accelerate's, two processes each on
this machine's CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from podagent.errors import ConfigError
from podagent.gang import mesh
from podagent.gang.datacheck import (
    SCRIPT,
    SENT_DIGESTS,
    check_loader_spec,
    compact,
    digest,
    judge,
    read_reports,
    samples_of,
    script_args,
)

torch = pytest.importorskip("torch")

RUN_TIMEOUT_S = 180  # three launches share two cores; a launch alone takes a few seconds


def _report(rank: int, pod: str, samples: list[str], world: int = 3, **extra) -> dict:
    return {"rank": rank, "world": world, "node": None, "local_rank": 0, "samples": samples,
            "batches": 1, "pod": pod, **extra}


def _digests(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:04x}" for i in range(n)]


# --- judge ---------------------------------------------------------------------------------

def test_judge_names_the_overlap_and_the_worst_pair():
    same = _digests("s", 64)
    reports = [_report(0, "a", same), _report(1, "b", same), _report(2, "c", _digests("c", 64))]
    verdict = judge(reports, 3)
    assert not verdict.ok
    assert verdict.line == ("data check: 3 ranks saw 192 samples, 128 of them on more than one "
                            "rank; ranks 0 (pod a) and 1 (pod b) share 64 of 64 samples")
    assert verdict.figures["shared"] == 128


def test_judge_worst_pair_is_the_one_sharing_most():
    reports = [_report(0, "a", _digests("x", 10) + _digests("a", 20)),
               _report(1, "a", _digests("x", 10) + _digests("y", 30)),
               _report(2, "b", _digests("y", 30) + _digests("c", 10))]
    verdict = judge(reports, 3)
    assert not verdict.ok
    assert verdict.line.endswith("ranks 1 (pod a) and 2 (pod b) share 30 of 40 samples")
    assert "3 ranks saw 110 samples, 80 of them on more than one rank" in verdict.line


def test_judge_passes_disjoint_ranks():
    reports = [_report(r, p, _digests(p, 64)) for r, p in enumerate("abc")]
    verdict = judge(reports, 3)
    assert verdict.ok
    assert verdict.line == ("data check: 3 ranks over 3 pods, 192 samples, none seen by two "
                            "ranks")


def test_judge_missing_ranks():
    reports = [_report(0, "a", _digests("a", 4)), _report(2, "c", _digests("c", 4))]
    verdict = judge(reports, 3)
    assert not verdict.ok
    assert verdict.line.startswith("data check: 2 of 3 ranks reported: rank(s) 1 ")
    assert verdict.figures["missing"] == [1]


def test_judge_one_global_rank_from_several_pods():
    # each pod ran its own world of two: ranks 0 and 1 twice, never 2 and 3
    reports = [_report(r, pod, _digests(f"{pod}{r}", 4), world=2) for pod in "ab" for r in (0, 1)]
    verdict = judge(reports, 4)
    assert not verdict.ok
    assert "did not form one run: rank 0 was reported by 2 pods (a, b)" in verdict.line
    assert "each node ran its own world (WORLD_SIZE 2)" in verdict.line


def test_judge_accelerate_processes_alone():
    reports = [_report(r, "a", _digests(str(r), 16), world=2, accelerate_processes=1,
                       accelerate_mode="DistributedType.NO") for r in (0, 1)]
    verdict = judge(reports, 2)
    assert not verdict.ok
    assert "accelerate saw 1 process(es) on 2 of 2 ranks where WORLD_SIZE is 2" in verdict.line
    assert "DistributedType.NO" in verdict.line and "ACCELERATE_USE_CPU=true" in verdict.line


def test_judge_lines_are_one_line():
    cases = [([], 2), ([_report(0, "a", ["x"]), _report(1, "c", ["x"])], 2)]
    for reports, world in cases:
        assert "\n" not in judge(reports, world).line


# --- pieces --------------------------------------------------------------------------------

def test_script_args():
    assert script_args(Path("out"), "torchrun", None) == (str(SCRIPT), "--out", "out", "--mode",
                                                          "torchrun")
    assert script_args(Path("o"), "accelerate", "f.py:g")[-2:] == ("--loader", "f.py:g")


def test_read_reports_marks_the_pod_and_skips_unreadable(tmp_path):
    (tmp_path / "rank-0.json").write_text(json.dumps({"rank": 0, "samples": ["a"]}))
    (tmp_path / "rank-1.json").write_text("{not json")
    (tmp_path / "rank-2.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps({"rank": 5}))
    assert read_reports(tmp_path, "pod-a") == [{"rank": 0, "samples": ["a"], "pod": "pod-a"}]


def test_check_loader_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("loaders.py").write_text("import functools\n\ndef build():\n    return []\n\n"
                                  "other = functools.partial(build)\n")
    Path("broken.py").write_text("def build(:\n")
    assert check_loader_spec("loaders.py:build") == f"{tmp_path / 'loaders.py'}:build"
    assert check_loader_spec("loaders.py:other").endswith("loaders.py:other")
    refused = {
        "loaders.py": "must be FILE:FUNC",
        "loaders.py:": "must be FILE:FUNC",
        "absent.py:build": "absent.py, which does not exist",
        "broken.py:build": "broken.py, which does not parse",
        "loaders.py:missing": "missing, which loaders.py does not define at its top level",
    }
    for spec, says in refused.items():
        with pytest.raises(ConfigError) as exc:
            check_loader_spec(spec)
        assert str(exc.value).startswith(f"--loader='{spec}' ") and says in str(exc.value)
        assert "\n" not in str(exc.value)


def test_samples_of_tensors_dicts_tuples_and_plain_values():
    rows = samples_of(torch.arange(6).reshape(3, 2))
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4, 5]]
    batch = {"ids": torch.tensor([[1, 2], [3, 4]]), "label": torch.tensor([0, 1]),
             "step": 7}  # a value for the whole batch goes with every row
    split = samples_of(batch)
    assert [(s["ids"].tolist(), s["label"].item(), s["step"]) for s in split] == [
        ([1, 2], 0, 7), ([3, 4], 1, 7)]
    pairs = samples_of((torch.tensor([5, 6]), ["five", "six"]))
    assert [(t.item(), text) for t, text in pairs] == [(5, "five"), (6, "six")]
    assert samples_of([1, 2, 3]) == [1, 2, 3]
    assert samples_of(["a", "b"]) == ["a", "b"]
    assert len(samples_of(torch.tensor(3.0))) == 1
    assert samples_of(42) == [42]


def test_digest_tells_samples_apart_by_content_dtype_and_shape():
    a, b = torch.arange(4), torch.arange(4)
    assert digest(a) == digest(b)
    assert digest(a) != digest(a.to(torch.int32))
    assert digest(a) != digest(a.reshape(2, 2))
    assert digest(torch.arange(4)[1]) == digest(torch.tensor(1))  # a row, not its storage
    assert digest(torch.zeros(2, dtype=torch.bfloat16)) != digest(torch.ones(2,
                                                                   dtype=torch.bfloat16))
    assert digest({"x": 1}) != digest({"x": 2})
    assert len(digest("text")) == 16


# --- real runs: two processes on this machine ----------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    # torch looks up host names; HF_HOME away from any accelerate default config of this user
    env.update(RES_OPTIONS="timeout:1 attempts:1", OMP_NUM_THREADS="1", HF_HOME=str(tmp / "hf"),
               **extra)
    return env


def _accelerate(out: Path) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
            *script_args(out, "accelerate", None)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The real runs, started together (each waits on its own processes' imports). Under
    torchrun, a loader that gives every rank the same samples is stopped through the command
    line (tests/unit/gang/test_run.py) and the default one passes on three pods
    (tests/e2e/test_without_ray.py): here, accelerate's way."""
    root = tmp_path_factory.mktemp("datacheck")
    commands = {"accelerate": (_accelerate(root / "accelerate"),
                               _env(root, ACCELERATE_USE_CPU="true"))}
    procs = {name: subprocess.Popen(argv, env=env, cwd=root, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name, (argv, env) in commands.items()}
    yield root, procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finished(launches, name: str) -> list[dict]:
    root, procs = launches
    try:
        output, _ = procs[name].communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        procs[name].kill()
        output, _ = procs[name].communicate()
        pytest.fail(f"{name} run did not end in {RUN_TIMEOUT_S} s:\n{output}")
    assert procs[name].returncode == 0, output
    return read_reports(root / name, "local")


def test_real_run_default_loader_accelerate_passes(launches):
    reports = _finished(launches, "accelerate")
    assert {(r["accelerate_processes"], r["accelerate_mode"]) for r in reports} == {
        (2, "DistributedType.MULTI_CPU")}
    verdict = judge(reports, 2)
    assert verdict.ok, verdict.line
    assert verdict.figures["samples"] == 32


# --- sent compact: the supervisor port carries any batch ------------------------------------

def _big_pod(pod: str, first_rank: int, ranks: int, per_rank: int, shared: int = 0) -> list:
    """8 ranks x 16 batches x 512 samples: more digests than one line may carry."""
    return [_report(first_rank + r, pod, [digest(f"{pod}-{r}-{i}") for i in range(per_rank)]
                    + [digest(f"common-{i}") for i in range(shared)], world=2 * ranks)
            for r in range(ranks)]


def test_a_large_check_is_sent_compact_and_judged_the_same():
    per_rank = 16 * 512
    a, b = _big_pod("a", 0, 8, per_rank), _big_pod("b", 8, 8, per_rank)
    sent = compact(b)
    assert len(json.dumps({"done": {"reports": sent}})) < mesh.LINE_LIMIT // 2
    assert sum(len(r["samples"]) for r in sent) <= 1.2 * SENT_DIGESTS
    verdict = judge(a + sent, 16)  # the head's own reports in full, a worker's compact
    assert verdict.ok, verdict.line
    assert verdict.figures["samples"] == 16 * per_rank
    assert verdict.line.startswith(f"data check: 16 ranks over 2 pods, {16 * per_rank} samples, "
                                   "none seen by two ranks (judged on a consistent sample of ")


def test_a_compact_check_still_finds_ranks_that_share_their_data():
    per_rank = 16 * 512
    a = _big_pod("a", 0, 8, per_rank // 2, shared=per_rank // 2)
    b = _big_pod("b", 8, 8, per_rank // 2, shared=per_rank // 2)
    verdict = judge(compact(a) + compact(b), 16)
    assert not verdict.ok
    # Half of every rank's samples are the same on all 16: the estimate is near that.
    assert abs(verdict.figures["shared"] / (16 * per_rank // 2) - 1) < 0.15, verdict.figures
    assert "share about" in verdict.line and "consistent sample" in verdict.line


def test_a_small_check_is_sent_whole():
    reports = [_report(0, "a", _digests("a", 64))]
    assert compact(reports) == reports
