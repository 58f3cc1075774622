"""The GPU check before the job (run/gpu_check.py): nvidia-smi's facts read and judged
(a stand-in nvidia-smi answers as the driver words it: tests/fakes/nvidia_smi.py), the probe
run for real as a child process (on the CPU with gloo: its ranks, its all-reduce, its deadline,
a signal), and the verdict's outcome: GpuCheckFailed (exit 28) naming each failure, or a pass."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from podagent import config
from podagent.errors import ConfigError, GpuCheckFailed, Interrupted
from podagent.report import Reporter
from podagent.run import exits
from podagent.run import gpu_check as gh
from podagent.waiting import Signals
from tests.fakes import nvidia_smi

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi first on PATH: smi(spec) sets what it answers."""
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def install(**spec):
        nvidia_smi.install(bin_dir, spec)
    return install


def _settings(tmp_path: Path, **env: str) -> config.Settings:
    return config.build({}, {"PODAGENT_LOG_DIR": str(tmp_path / "logs"), **env})


def _reporter() -> tuple[Reporter, io.StringIO]:
    out = io.StringIO()
    return Reporter("worker", "w1", None, stream=out), out


# --- nvidia-smi's facts -------------------------------------------------------------------------


def test_a_healthy_gpu_as_nvidia_smi_lists_it(smi):
    smi(gpus=[{"name": H100, "ecc": 0, "retire_pending": False, "remap_pending": False,
               "remap_failed": False, "memory_used": 1}])
    seen = gh.look()
    assert seen.failure == "" and seen.errors_known
    assert seen.gpus == (gh.SmiGpu(0, H100, "GPU-00000000-standin", 1, 0, False, False, False),)
    verdict = gh.Verdict()
    gh.judge_smi(seen, 1, "RUNPOD_GPU_COUNT", H100, verdict)
    assert verdict.ok and verdict.notes == []


@pytest.mark.parametrize(("fault", "said"), [
    ({"ecc": 3}, "3 uncorrected ECC error(s) since the driver loaded"),
    ({"retire_pending": True}, "a memory page is waiting to be retired"),
    ({"remap_pending": True}, "a row remapping is pending"),
    ({"remap_failed": True, "remap_pending": True}, "a row remapping failed"),
])
def test_each_memory_fault_fails_the_gpu_that_has_it(smi, fault, said):
    healthy = {"ecc": 0, "retire_pending": False, "remap_pending": False, "remap_failed": False}
    smi(gpus=[healthy, {**healthy, **fault}])
    verdict = gh.Verdict()
    gh.judge_smi(gh.look(), 2, "RUNPOD_GPU_COUNT", "", verdict)
    assert len(verdict.failures) == 1 and said in verdict.failures[0]
    assert verdict.failures[0].startswith("GPU 1 (GPU-00000001-standin): ")  # the one that has it


def test_fewer_gpus_than_the_pod_was_given_or_another_type_fail(smi):
    smi(gpus=[{"name": "NVIDIA A100-SXM4-80GB", "ecc": 0}])
    verdict = gh.Verdict()
    gh.judge_smi(gh.look(), 2, "RUNPOD_GPU_COUNT", H100, verdict)
    assert verdict.failures == [
        "1 GPU(s) visible to nvidia-smi, 2 expected (RUNPOD_GPU_COUNT)",
        f"GPU type NVIDIA A100-SXM4-80GB where {H100} was asked for (PODAGENT_GPU_TYPE)"]


def test_a_type_is_the_same_whatever_its_spacing_case_or_vendor_prefix():
    assert gh.same_gpu("NVIDIA H100 80GB HBM3", "h100  80gb hbm3")
    assert gh.same_gpu("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM4 80GB")
    assert not gh.same_gpu("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3")
    assert gh.peak_of("nvidia h200") == 989.0 and gh.peak_of("NVIDIA Z9") is None


def test_an_old_driver_without_the_error_fields_is_asked_the_basics_and_said(smi):
    smi(mode="old-driver", gpus=[{"name": H100}])
    seen = gh.look()
    assert seen.failure == "" and not seen.errors_known and len(seen.gpus) == 1
    verdict = gh.Verdict()
    gh.judge_smi(seen, 1, "RUNPOD_GPU_COUNT", H100, verdict)
    assert verdict.ok and "does not report ECC errors" in verdict.notes[0]


def test_error_fields_the_gpu_does_not_report_are_unknown_not_faults(smi):
    smi(gpus=[{"name": "NVIDIA GeForce RTX 4090"}])  # [N/A] for every error field
    seen = gh.look()
    assert seen.gpus[0].ecc_uncorrected is None and seen.gpus[0].remap_failed is None
    verdict = gh.Verdict()
    gh.judge_smi(seen, 1, "x", "", verdict)
    assert verdict.ok


def test_a_driver_that_fails_or_hangs_or_is_missing_fails_the_pod_with_its_words(smi, monkeypatch):
    smi(mode="nvml-error")
    seen = gh.look()
    assert seen.failure == "nvidia-smi exited 18: Failed to initialize NVML: Driver/library " \
                           "version mismatch"
    smi(mode="hang")
    began = time.monotonic()
    assert "did not answer within 1 s" in gh.look(timeout=1).failure
    assert time.monotonic() - began < 30
    monkeypatch.setenv("PATH", "/nonexistent")
    seen = gh.look()
    verdict = gh.Verdict()
    gh.judge_smi(seen, 8, "RUNPOD_GPU_COUNT", "", verdict)
    assert verdict.failures == ["8 GPU(s) expected (RUNPOD_GPU_COUNT) but nvidia-smi is not on "
                                "PATH (the NVIDIA driver's tools are missing from the "
                                "container)"]


@pytest.mark.parametrize("line", ["0, NVIDIA H100", "garbage"])
def test_a_line_with_too_few_fields_is_a_failure_not_a_crash(line):
    with pytest.raises(ValueError, match="field"):
        gh.parse_smi(line, with_errors=True)


# --- the probe's figures, judged ----------------------------------------------------------------


def _probe(*tflops: float, reduce_ok: bool = True) -> gh.Probe:
    ranks = [{"rank": i, "tflops": t,
              **({"reduce": {"ok": reduce_ok, "wrong": 0 if reduce_ok else 7, "busbw_gbs": 90.0}}
                 if len(tflops) > 1 else {})} for i, t in enumerate(tflops)]
    return gh.Probe(tuple(ranks), 12.0)


def test_a_gpu_below_its_types_rated_fraction_fails():
    verdict = gh.Verdict()
    gh.judge_probe(_probe(720.0, 410.0), [H100, H100], 0.5, verdict)
    assert verdict.failures == [f"GPU 1 ({H100}): 410 TFLOPS in a BF16 matmul, below 0.5 of "
                                f"its type's rated 989 (PODAGENT_GPU_MIN_SPEED)"]
    assert verdict.figures["tflops"] == [720.0, 410.0]


def test_a_gpu_of_an_unrated_type_is_held_to_its_siblings():
    verdict = gh.Verdict()
    names = ["NVIDIA Z9"] * 4
    gh.judge_probe(_probe(100.0, 101.0, 99.0, 60.0), names, 0.5, verdict)
    assert verdict.failures == ["GPU 3: 60 TFLOPS in a BF16 matmul, below 0.75 of its "
                                "siblings' median 100"]
    assert verdict.notes == ["no rated throughput known for NVIDIA Z9: its speed is compared "
                             "with its siblings only"]


def test_a_wrong_all_reduce_or_a_rank_error_or_a_failed_probe_fails():
    verdict = gh.Verdict()
    gh.judge_probe(_probe(700.0, 700.0, reduce_ok=False), [H100, H100], 0.5, verdict)
    assert verdict.failures[0] == ("GPU 0: the all-reduce across the pod's GPUs gave 7 wrong "
                                   "element(s)")
    verdict = gh.Verdict()
    gh.judge_probe(gh.Probe(({"rank": 0, "error": "RuntimeError: CUDA error: ECC"},)), [H100],
                   0.5, verdict)
    assert verdict.failures == ["GPU 0: RuntimeError: CUDA error: ECC"]
    verdict = gh.Verdict()
    gh.judge_probe(gh.Probe(failure="the GPU probe failed: x"), [H100], 0.5, verdict)
    assert verdict.failures == ["the GPU probe failed: x"]


# --- the probe, run -------------------------------------------------------------------------------


def _no_probe_left() -> bool:
    return not [p for p in psutil.process_iter(["cmdline"])
                if "podagent.run.gpu_probe" in " ".join(p.info["cmdline"] or [])]


def test_the_probe_measures_every_rank_and_reduces_across_them(tmp_path):
    """On the CPU (gloo), as on GPUs (NCCL): a process per rank, each rank's matmul, and an
    all-reduce whose sums are right."""
    probe = gh.run_probe(dict(os.environ), tmp_path / "probe.log", Signals(),
                         argv_tail=("--device", "cpu", "--count", "2"))
    assert probe.failure == "", probe.failure
    assert [r["rank"] for r in probe.ranks] == [0, 1]
    assert all(r["tflops"] > 0 and r["reduce"]["ok"] and r["reduce"]["wrong"] == 0
               for r in probe.ranks), probe.ranks
    verdict = gh.Verdict()
    gh.judge_probe(probe, [], 0.5, verdict)
    # Two CPU ranks share this machine's cores with the other test lanes: their speeds against
    # each other are noise here (the sibling rule has its own tests), the rest must pass.
    assert not [f for f in verdict.failures if "siblings' median" not in f], verdict.failures
    assert _no_probe_left()


def test_a_probe_past_its_deadline_is_stopped_with_its_ranks(tmp_path):
    probe = gh.run_probe(dict(os.environ), tmp_path / "probe.log", Signals(), timeout=0.5,
                         argv_tail=("--device", "cpu", "--count", "2"))
    assert probe.failure == ("the GPU probe did not finish within 0.5 s (a GPU or the "
                             "all-reduce hung); it was stopped")
    assert _no_probe_left()


def test_a_signal_during_the_probe_ends_the_check_and_the_probe(tmp_path):
    signals = Signals()
    signals.received = signal.SIGTERM
    with pytest.raises(Interrupted):
        gh.run_probe(dict(os.environ), tmp_path / "probe.log", signals,
                     argv_tail=("--device", "cpu", "--count", "2"))
    assert _no_probe_left()


def test_a_probe_without_cuda_says_so(tmp_path):
    probe = gh.run_probe(dict(os.environ), tmp_path / "probe.log", Signals())
    assert probe.failure.startswith("the GPU probe failed: torch ") and "sees no CUDA device" \
        in probe.failure


# --- the check's outcome ------------------------------------------------------------------------


def test_a_pod_whose_gpu_has_errors_fails_the_check_with_exit_28(smi, tmp_path):
    smi(gpus=[{"name": H100, "ecc": 2}])
    settings = _settings(tmp_path, PODAGENT_GPU_CHECK="smi", RUNPOD_GPU_COUNT="1",
                         PODAGENT_GPU_TYPE=H100)
    reporter, _ = _reporter()
    with pytest.raises(GpuCheckFailed) as raised:
        gh.check(settings, reporter, Signals(), dict(os.environ))
    assert str(raised.value) == ("GPU 0 (GPU-00000000-standin): 2 uncorrected ECC error(s) "
                                 "since the driver loaded")
    assert exits.exit_code(raised.value) == 28 and not exits.restartable(28)


def test_a_healthy_pod_passes_and_says_what_it_saw(smi, tmp_path):
    smi(gpus=[{"name": H100, "ecc": 0}, {"name": H100, "ecc": 0}])
    settings = _settings(tmp_path, PODAGENT_GPU_CHECK="smi", RUNPOD_GPU_COUNT="2")
    reporter, out = _reporter()
    verdict = gh.check(settings, reporter, Signals(), dict(os.environ))
    assert verdict is not None and verdict.ok
    assert "GPU check (smi) passed in " in out.getvalue()
    assert f"2 × {H100}" in out.getvalue()


def test_full_mode_on_a_pod_without_cuda_fails_rather_than_passing_untested(smi, tmp_path):
    smi(gpus=[{"name": H100, "ecc": 0}])
    settings = _settings(tmp_path, RUNPOD_GPU_COUNT="1")
    assert settings.gpu_check == "full"
    with pytest.raises(GpuCheckFailed, match="sees no CUDA device"):
        gh.check(settings, _reporter()[0], Signals(), dict(os.environ))


def test_busy_gpus_are_not_measured(smi, tmp_path):
    """A job already on the GPUs (a head re-attached to its run): its speed would be the job's."""
    smi(gpus=[{"name": H100, "ecc": 0, "memory_used": 60000}])
    settings = _settings(tmp_path, RUNPOD_GPU_COUNT="1")
    verdict = gh.check(settings, _reporter()[0], Signals(), dict(os.environ))
    assert verdict is not None and verdict.ok and "not measured" in verdict.notes[0]


def test_no_check_when_off_or_without_gpus(smi, tmp_path):
    smi(gpus=[{"name": H100, "ecc": 9}])
    reporter, _ = _reporter()
    assert gh.check(_settings(tmp_path, PODAGENT_GPU_CHECK="off", RUNPOD_GPU_COUNT="1"),
                    reporter, Signals(), {}) is None
    assert gh.check(_settings(tmp_path, PODAGENT_NUM_GPUS="0"), reporter, Signals(), {}) is None


def test_the_settings_refuse_nonsense_with_one_line(tmp_path):
    for env, name in (({"PODAGENT_GPU_CHECK": "maybe"}, "PODAGENT_GPU_CHECK"),
                      ({"PODAGENT_GPU_MIN_SPEED": "2"}, "PODAGENT_GPU_MIN_SPEED"),
                      ({"PODAGENT_GPU_TYPE": "x" * 101}, "PODAGENT_GPU_TYPE")):
        with pytest.raises(ConfigError) as raised:
            _settings(tmp_path, **env)
        assert raised.value.name == name and "\n" not in str(raised.value)


def test_the_probe_prints_one_json_object_even_without_torch_working(tmp_path):
    """Its answer is always a line the check can read."""
    from podagent.run import gpu_probe

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gpu_probe.main(["--device", "cpu", "--count", "1"]) == 0
    said = json.loads(out.getvalue())
    assert said["world"] == 1 and said["ranks"][0]["tflops"] > 0


# --- a stranger's bytes, and causes that are not the GPUs' -------------------------------------


@pytest.mark.parametrize(("raw", "says"), [
    (b"0, NVIDIA H\xff100, GPU-a, 0, 0, No, No, No\n", "GPU type NVIDIA H\ufffd100"),
    (b"0, NVIDIA H100 80GB HBM3, extra, GPU-a, 0, 0, No, No, No\n", "gave 9 field(s) where 8"),
    (b"", "0 GPU(s) visible to nvidia-smi, 1 expected"),
    (b"0, NVIDIA H100 80GB HBM3, GPU-a, 0, 0, No, No, No\n" * 2,
     "1 GPU(s) visible to nvidia-smi, 2 expected"),  # one GPU listed twice is one
    (b"0, x, GPU-a, 0, 0, No, No, No\n" * 65, "more than 64 GPUs"),
])
def test_odd_nvidia_smi_answers_are_one_clear_failure_never_a_crash(smi, raw, says):
    smi(mode="raw", raw_hex=raw.hex())
    verdict = gh.Verdict()
    expected = 2 if raw.count(b"\n") == 2 else 1
    gh.judge_smi(gh.look(), expected, "RUNPOD_GPU_COUNT", H100, verdict)
    assert not verdict.ok and any(says in f for f in verdict.failures), verdict.failures


def test_a_mig_slice_is_its_gpus_type_and_held_to_its_siblings_only():
    assert gh.same_gpu("NVIDIA RTX PRO 6000 Blackwell Server Edition MIG 1g.24gb",
                       "NVIDIA RTX PRO 6000 Blackwell Server Edition")
    assert gh.is_mig("NVIDIA A100-SXM4-80GB MIG 3g.40gb") and not gh.is_mig(H100)
    verdict = gh.Verdict()
    gh.judge_probe(_probe(90.0), ["NVIDIA A100-SXM4-80GB"], 0.5, verdict, rated=False)
    assert verdict.ok and verdict.notes == ["a MIG slice: its speed is compared with its "
                                            "siblings only"]


def test_without_torch_the_speed_is_not_measured_and_the_pod_passes(smi, tmp_path):
    """No torch in podagent's Python is the image's, not the GPUs': replacing the pod would
    meet the same image. Said, not a GPU fault."""
    broken = tmp_path / "no_torch"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    env = {**os.environ, "PYTHONPATH": f"{broken}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    probe = gh.run_probe(env, tmp_path / "probe.log", Signals())
    assert probe.failure == "" and "torch could not be imported" in probe.skipped
    verdict = gh.Verdict()
    gh.judge_probe(probe, [H100], 0.5, verdict)
    assert verdict.ok and "speed and all-reduce not measured" in verdict.notes[0]


def test_the_probes_work_directory_goes_however_it_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    for timeout in (0.5, gh.PROBE_TIMEOUT):
        gh.run_probe(dict(os.environ), tmp_path / "probe.log", Signals(), timeout=timeout,
                     argv_tail=("--device", "cpu", "--count", "2"))
        assert list((tmp_path / "tmp").iterdir()) == []
    assert _no_probe_left()
