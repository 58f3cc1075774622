"""What `podagent up`, `down` and `ls` do, apart from click: the key, the client, the view.
Errors are raised; the CLI turns them into lines and exit codes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from podagent import extras
from podagent.errors import InputError
from podagent.launch import down as downs
from podagent.launch import spec as specs
from podagent.launch import state
from podagent.launch import view as views
from podagent.launch.spec import UpSpec
from podagent.launch.up import Up
from podagent.platform.runpod_api import DEFAULT_V2_URL, Client

API_KEY = "RUNPOD_API_KEY"
API_KEY_FILE = "RUNPOD_API_KEY_FILE"
API_URL = "RUNPOD_API_URL"
API_TIMEOUT = 60.0  # one API call, its retries included (`up --api-timeout`)


def api_url(environ: Mapping[str, str]) -> str:
    return environ.get(API_URL, "").strip() or DEFAULT_V2_URL


def api_key(environ: Mapping[str, str], key_file: str | None) -> str:
    """From RUNPOD_API_KEY, else a file (--api-key-file or RUNPOD_API_KEY_FILE): never from
    the command line, where every user of the machine could read it."""
    key = environ.get(API_KEY, "").strip()
    if key:
        return key
    path = key_file or environ.get(API_KEY_FILE, "").strip()
    if not path:
        raise InputError(f"no RunPod API key: set {API_KEY}, or give --api-key-file FILE "
                          f"(a key is never taken from the command line)")
    try:
        key = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise InputError(f"--api-key-file {path!r}: cannot be read "
                          f"({exc.strerror or exc})") from None
    if not key:
        raise InputError(f"--api-key-file {path!r}: is empty (it should hold the key)")
    return key


class CallCounter:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, method: str, path: str, status: int) -> None:
        self.count += 1


def client(key: str, url: str, say: Callable[[str], None],
           timeout: float = API_TIMEOUT) -> tuple[Client, CallCounter]:
    counter = CallCounter()
    return Client(key, url, timeout=timeout, say=say, on_call=counter), counter


def up(spec: UpSpec, key: str, explain: Callable[[int], str],
       stream: TextIO | None = None) -> int:
    extras.require("up", "podagent up's live view")
    view = views.choose(stream)
    api, counter = client(key, spec.api_url, lambda line: view.line(f"[up] {line}"),
                          spec.api_timeout)
    try:
        return Up(spec, api, view, calls=lambda: counter.count, explain=explain).run()
    finally:
        view.close()
        api.close()


def down(run: str, key: str, url: str, state_dir: Path, say: Callable[[str], None],
         timeout: float) -> int:
    """Terminate the run's pods; how many there were."""
    api, _ = client(key, url, say)
    try:
        record = state.load(state_dir, run)
        found = downs.find(api, run, record)
        if not found:
            say(f"run {run}: nothing of it at RunPod")
            if record is not None:
                record.mark(state.DOWN)
            return 0
        return downs.terminate(api, run, record, say, timeout=timeout)
    finally:
        api.close()


def ls(key: str, url: str, state_dir: Path, out: TextIO = sys.stdout) -> int:
    """The runs this machine started and every pod at RunPod that `up` created, with what
    they cost per hour now. Returns how many pods are billing."""
    api, _ = client(key, url, lambda line: out.write(f"[ls] {line}\n"))
    try:
        pods = [p for p in api.list_pods(include_cluster_pods=True)
                if specs.run_of(p) or any(specs.belongs(p, r.run)
                                          for r in state.all_records(state_dir))]
    finally:
        api.close()
    records = {r.run: r for r in state.all_records(state_dir)}
    runs: dict[str, list[dict[str, Any]]] = {run: [] for run in records}
    for pod in pods:
        run = specs.run_of(pod) or next(r for r in records if specs.belongs(pod, r))
        runs.setdefault(run, []).append(pod)
    if not runs:
        out.write("no runs: `podagent up` starts one\n")
        return 0
    billing = 0
    rows = [("run / pod", "id", "status", "$/h")]
    total = 0.0
    for run, its_pods in sorted(runs.items()):
        record = records.get(run)
        told = record.status if record else "no local record"
        cost = sum(float(p.get("cost") or 0.0) for p in its_pods)
        total += cost
        rows.append((run, "", f"{told}, {len(its_pods)} pod(s)", f"{cost:.2f}"))
        for pod in sorted(its_pods, key=lambda p: str(p.get("name"))):
            billing += pod.get("status") in ("PROVISIONING", "STARTING", "RUNNING")
            rows.append((f"  {pod.get('name')}", str(pod.get("id")), str(pod.get("status")),
                         f"{float(pod.get('cost') or 0.0):.2f}"))
    rows.append(("total", "", f"{billing} pod(s) billing", f"{total:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        out.write("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
                  + "\n")
    return billing


def environ() -> Mapping[str, str]:
    return os.environ
