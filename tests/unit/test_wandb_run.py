"""The bring-up as a W&B run: real wandb in offline mode, read back from its own files.

Events go through a real Reporter, wandb runs its real service process, and the test reads the
run's .wandb file back with wandb's own protobuf messages.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import psutil
import pytest
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from podagent import config
from podagent.config.policy import is_secret
from podagent.errors import RayStartError
from podagent.platform.roles import Role
from podagent.report import REDACTED, Reporter, wandb_run

# A recognizable fake key of a real key's length (40 characters).
KEY = "f4kek3y0" * 5
RUN = "wb-unit"


# --- reading an offline run back -----------------------------------------------------------------

# wandb 0.31 has no Python reader for .wandb files (its Go service writes and syncs them). The
# file is LevelDB's log format: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB
# blocks of chunks, each with a 7-byte header (CRC-32 of type+data, length, type). The records
# themselves are wandb's own protobuf messages.
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad CRC at {pos}"
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


class OfflineRun:
    """The one offline run under run_dir/wandb: its run record, history, summary and exit."""

    def __init__(self, run_dir: Path):
        (self.path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
        self.files = self.path.parent / "files"
        self.records = read_records(self.path)
        kinds = [r.WhichOneof("record_type") for r in self.records]
        (self.run,) = [r.run for r in self.records if r.WhichOneof("record_type") == "run"]
        self.history = [{_key(i): json.loads(i.value_json) for i in r.history.item}
                        for r in self.records if r.WhichOneof("record_type") == "history"]
        self.summary: dict[str, Any] = {}
        for r in self.records:
            if r.WhichOneof("record_type") == "summary":
                for item in r.summary.update:
                    self.summary[_key(item)] = json.loads(item.value_json)
        assert "exit" in kinds, kinds
        (self.exit,) = [r.exit for r in self.records if r.WhichOneof("record_type") == "exit"]

    def values(self, metric: str) -> list[Any]:
        return [row[metric] for row in self.history if metric in row]

    def table(self, key: str) -> list[dict[str, Any]]:
        # A table's summary entry is a reference to a file of the run (nested keys under key).
        assert self.summary.get(f"{key}/_type") == "table-file", self.summary
        table = json.loads((self.files / self.summary[f"{key}/path"]).read_text())
        return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


# --- fixtures ------------------------------------------------------------------------------------


def _children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


@pytest.fixture
def wandb_env(tmp_path, monkeypatch) -> dict[str, str]:
    """Offline W&B with a fake key; wandb's own state dirs under tmp_path, so the test can
    search everything it wrote."""
    for name in list(os.environ):
        if name.startswith("WANDB_"):
            monkeypatch.delenv(name)
    env = {"WANDB_MODE": "offline", "WANDB_API_KEY": KEY, "WANDB_PROJECT": "bringup-test",
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
           # Meant for the job's runs: the bring-up run must not take them.
           "WANDB_NAME": "the-job", "WANDB_RUN_ID": "jobrun01", "WANDB_RESUME": "must"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env
    assert not [p for p in _children() if p.name() == wandb_run.SERVICE_NAME], \
        "wandb's service outlived the run"
    assert wandb_run.SERVICE_TOKEN not in os.environ


def make(tmp_path, environ: dict[str, str], **extra: str) -> tuple[config.Settings, Reporter,
                                                                 io.StringIO]:
    env = {**environ, "PODAGENT_LOG_DIR": str(tmp_path / "logs"), "PODAGENT_RUN_NAME": RUN,
           **extra}
    settings = config.build({}, env)
    stream = io.StringIO()
    secrets = [v for k, v in env.items() if is_secret(k) and v]
    return settings, Reporter("head", "pod1", settings.run_dir, secrets, stream=stream), stream


def wait_for_service(bringup: wandb_run.BringupRun) -> psutil.Process:
    def probe() -> psutil.Process | str | None:
        return bringup.service if bringup.failure is None else bringup.failure

    try:
        service = Retrying(stop=stop_after_delay(60), wait=wait_fixed(0.05),
                           retry=retry_if_result(lambda found: found is None))(probe)
    except RetryError:
        raise AssertionError("wandb's service did not start within 60 s") from None
    assert isinstance(service, psutil.Process), service
    return service


def wandb_dirs(tmp_path: Path) -> list[Path]:
    return [tmp_path / "wandb-cache", tmp_path / "wandb-config", tmp_path / "wandb-data"]


def assert_key_nowhere(*roots: Path) -> None:
    needle = KEY.encode()
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert needle not in path.read_bytes(), f"the key is in {path}"


# --- the bring-up, recorded ----------------------------------------------------------------------


def bring_up(reporter: Reporter) -> None:
    """The events of a head that forms a 3-node cluster and runs the check and a job."""
    reporter.event("state", state="preparing")
    reporter.event("prepared", preset="loopback", node_ip="10.0.0.1", gpus=2, nccl={},
                   warnings=[])
    with reporter.step("ray_head") as step:
        step.done("Ray head up", address="10.0.0.1:6379")
    reporter.event("worker_joined", ip="10.0.0.2", gpus=2.0, node_id="n2", registered_ms=1)
    reporter.event("worker_joined", ip="10.0.0.3", gpus=1.0, node_id="n3", registered_ms=2)
    with reporter.step("workers_joined") as step:
        step.done("cluster ready", nodes=3, gpus=5)
    with reporter.step("job_submitted") as step:
        step.done("job submitted", submission_id=RUN, new=True)
    reporter.event("check", passed=True, backend="gloo", world=3, failures=[], busbw=1.5,
                   algbw=0.75, payload_bytes=1 << 20, transport=["gloo/TCP via lo"],
                   nodes=[{"node": "10.0.0.1", "ranks": [0], "all_reduce": True, "busbw": 1.5},
                          {"node": "10.0.0.2", "ranks": [1], "all_reduce": True, "busbw": 1.6}])
    with reporter.step("job_finished") as step:
        step.done("job SUCCEEDED", status="SUCCEEDED")
    reporter.event("teardown", outcome="succeeded", processes=7, killed=0)
    reporter.event("exit", code=0)


def test_offline_run_records_stages_nodes_check_and_outcome(tmp_path, wandb_env):
    settings, reporter, stream = make(tmp_path, wandb_env)
    bringup = wandb_run.attach(reporter, settings, Role.HEAD)
    assert bringup is not None
    assert stream.getvalue().splitlines() == [
        f"[head] W&B: logging bring-up to project bringup-test (offline; files in "
        f"{settings.run_dir}/wandb)"]
    bring_up(reporter)
    service = wait_for_service(bringup)
    # wandb's service runs with the key in its environment (as the user's job does), never
    # on a command line: neither its own nor any other process's of ours.
    assert service.name() == wandb_run.SERVICE_NAME
    for proc in [service, *_children()]:
        assert KEY not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert wandb_run.SERVICE_TOKEN not in os.environ
    bringup.finish(0)
    reporter.close()

    run = OfflineRun(settings.run_dir)
    assert (run.run.project, run.run.run_group, run.run.display_name, run.run.job_type) == (
        "bringup-test", RUN, f"{RUN}-bringup", "bringup")
    assert run.run.run_id == bringup.run_id != "jobrun01"
    for stage in ("ray_head", "workers_joined", "job_submitted", "job_finished"):
        (value,) = run.values(f"stage/{stage}_s")
        assert isinstance(value, (int, float)) and value >= 0, (stage, value)
    # Nodes and GPUs as they joined: the head alone, +1 worker, +1 worker, then the census.
    assert run.values("cluster/nodes") == [1, 2, 3, 3]
    assert run.values("cluster/gpus") == [2, 4, 5, 5]
    assert all(row["elapsed_s"] >= 0 for row in run.history if "cluster/nodes" in row)
    assert run.values("check/passed") == [1]
    assert (run.summary["check/busbw"], run.summary["check/world"]) == (1.5, 3)
    assert run.summary["check/transport"] == "gloo/TCP via lo"
    assert [row["node"] for row in run.table("check/node_table")] == ["10.0.0.1", "10.0.0.2"]
    assert run.summary["job_status"] == "SUCCEEDED"
    assert run.summary["exit_code"] == 0 and run.exit.exit_code == 0
    assert run.summary["outcome"] == "succeeded"
    assert run.summary["time_to_job_s"] >= 0
    nodes = run.table("cluster/node_table")
    assert [(n["role"], n["ip"], n["gpus"], n["state"]) for n in nodes] == [
        ("head", "10.0.0.1", 2, "alive"), ("worker", "10.0.0.2", 2, "alive"),
        ("worker", "10.0.0.3", 1, "alive")]
    config_text = "".join(str(r.run.config) for r in run.records if r.HasField("run"))
    assert "podagent_version" in config_text and "cluster check" in config_text
    # podagent's own output only: nothing from wandb.
    assert all(line.startswith("[head] ") for line in stream.getvalue().splitlines()), \
        stream.getvalue()
    assert_key_nowhere(settings.run_dir, *wandb_dirs(tmp_path))


def test_failed_job_after_a_lost_worker(tmp_path, wandb_env):
    settings, reporter, _ = make(tmp_path, wandb_env, PODAGENT_JOB="python train.py")
    bringup = wandb_run.attach(reporter, settings, "head")
    assert bringup is not None
    reporter.event("prepared", preset="loopback", node_ip="10.0.0.1", gpus=0, nccl={},
                   warnings=[])
    reporter.event("worker_joined", ip="10.0.0.2", gpus=1.0, node_id="n2", registered_ms=1)
    with reporter.step("workers_joined") as step:
        step.done("cluster ready", nodes=2, gpus=1)
    reporter.event("worker_lost", ip="10.0.0.2", node_id="n2")
    with reporter.step("job_finished") as step:
        step.done("job FAILED", status="FAILED")
    # An error that quotes the key: the Reporter redacts it before W&B sees it.
    reporter.event("exit", code=3, error=f"job {RUN} failed (exit code 3); key was {KEY}")
    bringup.finish(3)
    reporter.close()

    run = OfflineRun(settings.run_dir)
    assert run.values("cluster/nodes") == [1, 2, 2, 1]
    assert run.values("cluster/workers_lost") == [1]
    assert run.summary["job_status"] == "FAILED"
    assert run.summary["exit_code"] == 3 and run.exit.exit_code == 3
    assert run.summary["error"] == f"job {RUN} failed (exit code 3); key was {REDACTED}"
    assert [n["state"] for n in run.table("cluster/node_table")] == ["alive", "lost"]
    assert "python train.py" in "".join(str(r.run.config) for r in run.records
                                        if r.HasField("run"))
    assert_key_nowhere(settings.run_dir, *wandb_dirs(tmp_path))


def test_a_failed_step_names_the_stage_and_no_job_ran(tmp_path, wandb_env):
    settings, reporter, _ = make(tmp_path, wandb_env)
    bringup = wandb_run.attach(reporter, settings, Role.HEAD)
    assert bringup is not None
    with pytest.raises(RayStartError), reporter.step("ray_head"):
        raise RayStartError("Ray failed to start")
    reporter.event("exit", code=8, error="Ray failed to start")
    bringup.finish(8)
    reporter.close()

    run = OfflineRun(settings.run_dir)
    assert len(run.values("stage/ray_head_s")) == 1
    assert run.summary["failed_stage"] == "ray_head"
    assert run.summary["job_status"] == "not run"
    assert run.exit.exit_code == 8


# --- when nothing is logged, and when W&B fails ---------------------------------------------------


def test_without_a_key_one_info_line_and_nothing_else(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("WANDB_"):
            monkeypatch.delenv(name)
    settings, reporter, stream = make(tmp_path, {"WANDB_PROJECT": "p"})
    assert wandb_run.attach(reporter, settings, Role.HEAD) is None
    reporter.event("exit", code=0)
    reporter.close()
    assert stream.getvalue() == f"[head] {wandb_run.NO_KEY}\n"
    assert wandb_run.NO_KEY == "W&B: WANDB_API_KEY not set; bring-up is not logged to W&B"
    assert not (settings.run_dir / "wandb").exists()


@pytest.mark.parametrize(("environ", "mode", "line"), [
    ({}, None, wandb_run.NO_KEY),
    ({"WANDB_API_KEY": "  "}, None, wandb_run.NO_KEY),
    ({"WANDB_MODE": "online"}, None, wandb_run.NO_KEY),
    ({"WANDB_API_KEY": KEY}, "online", "W&B: logging bring-up to project podagent"),
    ({"WANDB_API_KEY": KEY, "WANDB_PROJECT": "rl"}, "online",
     "W&B: logging bring-up to project rl"),
    ({"WANDB_MODE": "offline"}, "offline", "W&B: logging bring-up to project podagent (offline)"),
    ({"WANDB_MODE": "dryrun"}, "offline", "W&B: logging bring-up to project podagent (offline)"),
    ({"WANDB_MODE": "disabled", "WANDB_API_KEY": KEY}, None,
     "W&B: WANDB_MODE=disabled; bring-up is not logged to W&B"),
])
def test_decide(environ, mode, line):
    decision = wandb_run.decide(environ)
    assert (decision.mode, decision.line) == (mode, line)
    assert KEY not in decision.line


def test_workers_do_not_log(tmp_path, wandb_env):
    settings, reporter, stream = make(tmp_path, wandb_env)
    assert wandb_run.attach(reporter, settings, Role.WORKER) is None
    assert stream.getvalue() == ""


def test_a_run_wandb_refuses_is_one_warning_and_podagent_goes_on(tmp_path, wandb_env):
    settings, reporter, stream = make(tmp_path, {**wandb_env, "WANDB_PROJECT": "bad/name"})
    bringup = wandb_run.attach(reporter, settings, Role.HEAD)
    assert bringup is not None
    bring_up(reporter)
    bringup.finish(0)
    reporter.close()
    warnings = [line for line in stream.getvalue().splitlines() if "WARNING" in line]
    assert len(warnings) == 1, stream.getvalue()
    assert warnings[0].startswith("[head] WARNING: W&B: could not start the bring-up run "
                                  "(UsageError: Invalid project name"), warnings
    # The events still went to events.jsonl.
    events = (settings.run_dir / "events.jsonl").read_text().splitlines()
    assert json.loads(events[-1])["event"] == "exit"


# --- the Reporter's listeners ---------------------------------------------------------------------


def test_listeners_get_redacted_records_even_without_an_events_file():
    stream = io.StringIO()
    reporter = Reporter("head", "pod1", None, secrets=[KEY], stream=stream)
    seen: list[dict[str, Any]] = []
    reporter.add_listener(seen.append)
    reporter.event("login", token=KEY, nested={"inner": [f"x{KEY}"]}, count=2)
    assert seen == [{"ts": seen[0]["ts"], "pod": "pod1", "role": "head", "event": "login",
                     "token": REDACTED, "nested": {"inner": [f"x{REDACTED}"]}, "count": 2}]
    assert stream.getvalue() == ""


def test_a_listener_that_raises_is_switched_off_with_one_warning(tmp_path):
    stream = io.StringIO()
    reporter = Reporter("head", "pod1", tmp_path / "run", secrets=[KEY], stream=stream)
    calls: list[str] = []
    seen: list[str] = []

    def broken(record: dict[str, Any]) -> None:
        calls.append(record["event"])
        raise ValueError(f"cannot handle {record['event']}")

    def mutating(record: dict[str, Any]) -> None:
        record["event"] = "changed"

    reporter.add_listener(broken)
    reporter.add_listener(mutating)
    reporter.add_listener(lambda record: seen.append(record["event"]))
    for name in ("one", "two", "three"):
        reporter.event(name)
    reporter.close()
    assert calls == ["one"]
    assert seen == ["one", "two", "three"]
    lines = stream.getvalue().splitlines()
    assert lines == ["[head] WARNING: event listener test_a_listener_that_raises_is_switched_off"
                     "_with_one_warning.<locals>.broken failed and is switched off: "
                     "ValueError: cannot handle one"]
    written = [json.loads(line)["event"]
               for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert written == ["one", "two", "three"]
