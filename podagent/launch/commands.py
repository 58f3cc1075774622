"""What `podagent up`, `down` and `ls` do, apart from click: the key, the client, the view.
Errors are raised; the CLI turns them into lines and exit codes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from podagent import extras
from podagent.choices import AfterRun
from podagent.config.building import read_fields
from podagent.config.fields import FIELD_BY_ATTR
from podagent.config.policy import RUNPOD_API_KEY, runpod_key
from podagent.errors import InputError, PodsLeftBilling, PodsNotReady, RunPodApiError
from podagent.launch import down as downs
from podagent.launch import spec as specs
from podagent.launch import state
from podagent.launch import view as views
from podagent.launch.interrupts import Interrupts
from podagent.launch.spec import UpSpec
from podagent.launch.up import Up
from podagent.platform.runpod_api import BILLING_STATUSES, Client, rfc3339_ns

API_TIMEOUT = 60.0  # one API call, its retries included (`up --api-timeout`)


def api_url(environ: Mapping[str, str]) -> str:
    """RUNPOD_API_URL, read and checked as the pods read it (config.fields.FIELDS holds the one
    definition: name, rule, default)."""
    field = FIELD_BY_ATTR["runpod_api_url"]
    values, _ = read_fields([field], {}, environ)
    return values.get("runpod_api_url", field.default)


def api_key(environ: Mapping[str, str], key_file: str | None) -> str:
    """From RUNPOD_API_KEY, else a file (--api-key-file or RUNPOD_API_KEY_FILE): never from
    the command line, where every user of the machine could read it."""
    key = runpod_key(environ, key_file)
    if not key:
        raise InputError(f"no RunPod API key: set {RUNPOD_API_KEY}, or give "
                         f"--api-key-file FILE (a key is never taken from the command line)")
    return key


def client(key: str, url: str, say: Callable[[str], None],
           timeout: float = API_TIMEOUT) -> Client:
    return Client(key, url, timeout=timeout, say=say)


def up(spec: UpSpec, key: str, interrupts: Interrupts,
       stream: TextIO | None = None, follow_only: bool = False) -> int:
    extras.require("up", "podagent up's live view")
    view = views.Unblocked(views.choose(stream))
    api = client(key, spec.api_url, lambda line: view.line(f"[up] {line}"), spec.api_timeout)
    try:
        return Up(spec, api, view, interrupts, follow_only=follow_only).run()
    finally:
        view.close()
        api.close()


def reattach_spec(run: str, key: str, url: str, state_dir: Path, api_timeout: float,
                  timeout: float | None,
                  say: Callable[[str], None] | None = None) -> UpSpec:
    """`podagent up --name RUN` alone: the run's spec from this machine's record, else from
    its pods at RunPod (their number, their GPU type, a cluster or not, --keep's)."""
    say = say or (lambda line: print(f"[up] {line}", flush=True))
    record = state.load_hint(state_dir, run, say)
    if record is not None and record.spec and record.spec.get("run") == run:
        try:
            spec = UpSpec.from_record(record.spec, api_url=url, api_timeout=api_timeout,
                                      state_dir=state_dir, timeout=timeout)
            counts = (spec.pods, spec.gpus_per_pod)
            if all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts) \
                    and isinstance(spec.gpu_type, str):
                return spec
        except (TypeError, ValueError, AttributeError):
            pass  # a record of an older podagent, or a damaged one: from RunPod then
    api = client(key, url, lambda line: None, api_timeout)
    try:
        pods = [p for p in downs.find(api, run, record).pods if p.get("status") != "TERMINATED"]
    finally:
        api.close()
    if not pods:
        raise PodsNotReady(f"run {run}: nothing of it at RunPod and no record of it here: "
                           f"`podagent up` needs --image (or --template) and --gpu to start "
                           f"it")
    gpu = pods[0].get("gpu") or {}
    # The pods were told whether to stay up after the run (--keep): follow them alike.
    keep = any((p.get("env") or {}).get("PODAGENT_AFTER_RUN") == AfterRun.STAY.value
               for p in pods)
    return UpSpec(run=run, gpu_type=str(gpu.get("id") or "?"),
                  gpus_per_pod=int(gpu.get("count") or 1), pods=len(pods),
                  image=str(pods[0].get("image") or "") or None,
                  cluster=any(p.get("cluster") for p in pods), keep=keep, api_url=url,
                  api_timeout=api_timeout, state_dir=state_dir,
                  deadline=specs.deadline_of(pods), env=_stop_timeout(pods),
                  **({"timeout": timeout} if timeout is not None else {}))


def _stop_timeout(pods: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """The job's stop grace as the pods were given it (`up` waits it out at a cap)."""
    name = FIELD_BY_ATTR["stop_timeout"].env
    given = {str((p.get("env") or {}).get(name)) for p in pods
             if isinstance((p.get("env") or {}).get(name), str)}
    return ((name, given.pop()),) if len(given) == 1 else ()


def down(run: str, key: str, url: str, state_dir: Path, say: Callable[[str], None],
         timeout: float, volume: Callable[[str], bool] | None = None) -> int:
    """Terminate the run's pods; how many there were. `volume`: the run's network volume is
    deleted too, once the pods are gone, if it answers yes to the question it is asked."""
    count = _down_pods(run, key, url, state_dir, say, timeout)
    _settle_volume(run, key, url, state_dir, say, timeout, volume)
    return count


def _settle_volume(run: str, key: str, url: str, state_dir: Path, say: Callable[[str], None],
                   timeout: float, confirm: Callable[[str], bool] | None) -> None:
    """The run's network volume, once its pods are gone: deleted if `confirm` says so, else
    said to be kept (what it costs a month, how to delete it)."""
    api = client(key, url, say, min(API_TIMEOUT, timeout))
    try:
        record = state.load_hint(state_dir, run, lambda line: None)
        known = set(record.ids("volume")) if record else set()
        try:
            found = [v for v in api.network_volumes()
                     if v["id"] in known or v["name"] == specs.volume_name(run)]
        except RunPodApiError as exc:
            if confirm is not None:
                raise
            say(f"could not list the network volumes ({exc}): `podagent ls` shows whether "
                f"run {run} has one kept")
            return
        if not found and confirm is not None:
            say(f"run {run} has no network volume at RunPod")
        for volume in found:
            size = int(volume["size"])
            what = (f"network volume {volume['name']} ({volume['id']}, {size} GB in "
                    f"{volume['dataCenter']})")
            if confirm is None:
                say(f"kept: {what}, about ${specs.volume_price(size):.2f}/month, with what the "
                    f"run's pods wrote, if any ran; `podagent down {run} --volume` deletes it")
            elif confirm(f"Delete {what}, and the checkpoints and model on it, for good?"):
                api.delete_network_volume(str(volume["id"]))
                say(f"deleted {what}")
            else:
                say(f"kept {what}")
    finally:
        api.close()


def _down_pods(run: str, key: str, url: str, state_dir: Path, say: Callable[[str], None],
               timeout: float) -> int:
    # Each call's retries end within --timeout too: `down --timeout 3` against a RunPod that
    # keeps refusing gives up (exit 26) in seconds, not after a minute of retries.
    api = client(key, url, say, min(API_TIMEOUT, timeout))
    try:
        record = state.load_hint(state_dir, run, say)
        # A create whose answer never came (`up` left on a second signal, or lost it) may
        # still make its pod: nothing listed is not the end until it no longer can (within
        # --timeout, which is then given again for the terminate).
        found = _listed(api, run, record)
        landed = found.live_by_name() if found is not None else {}
        window = record.landing_left(time.time(), landed) if record else 0.0
        landing = min(window, timeout)
        try:
            if found is not None and not found and not landing:
                say(f"run {run}: nothing of it at RunPod")
                if record is not None:
                    record.try_mark(state.DOWN)
                return 0
            sweep = downs.Sweep()
            count = downs.terminate(api, run, record, say, timeout=timeout + landing,
                                    sweep=sweep, landing_time=landing,
                                    landing_cut=window > timeout)
            if sweep.cut_short and record is not None:  # a window implies a record
                record.try_mark(state.LEFT_BILLING)
                raise PodsLeftBilling(
                    f"run {run}: a create whose answer never came may still make a pod for "
                    f"{window - timeout:.0f} s more, past --timeout {timeout:g}; `podagent down "
                    f"{run}` after that terminates it (its pods may still bill)")
            return count
        except RunPodApiError as exc:  # its one job failed: what it terminates may bill on
            said = str(exc)
            if "podagent down" not in said:
                said += f"; `podagent down {run}` again terminates them"
            raise PodsLeftBilling(f"{said} (its pods may still bill)") from None
    finally:
        api.close()


def _listed(api: Client, run: str, record: state.RunRecord | None) -> downs.Found | None:
    """What RunPod lists of the run; None when it cannot list (the terminate then asks for
    the recorded ids)."""
    try:
        return downs.find(api, run, record)
    except RunPodApiError:
        return None


def _billed_so_far(pod: Mapping[str, Any], now: float) -> float:
    """A pod still billing: its rate times the time since RunPod created it."""
    created = rfc3339_ns(pod.get("createdAt"))
    if pod.get("status") not in BILLING_STATUSES or created is None:
        return 0.0
    return float(pod.get("cost") or 0.0) * max(0.0, now - created / 1e9) / 3600.0


def ls(key: str, url: str, state_dir: Path, out: TextIO = sys.stdout) -> int:
    """The runs this machine started and every pod at RunPod that `up` created: their state,
    what they cost per hour now, and what each run has cost (its record's figure once it is
    over; for pods still billing, their rate since RunPod created them). Returns how many
    pods are billing."""
    api = client(key, url, lambda line: out.write(f"[ls] {line}\n"))
    records = {r.run: r for r in state.all_records(
        state_dir, lambda line: out.write(f"[ls] {line}\n"))}
    try:
        pods = [p for p in api.list_pods(include_cluster_pods=True)
                if specs.run_of(p) or any(specs.belongs(p, r) for r in records)]
        ours = {i for r in records.values() for i in r.ids("volume")}
        volumes = [v for v in api.network_volumes()
                   if v["id"] in ours or str(v["name"]).startswith(f"{specs.PREFIX}-")]
    finally:
        api.close()
    runs: dict[str, list[dict[str, Any]]] = {run: [] for run in records}
    for pod in pods:
        run = specs.run_of(pod) or next(r for r in records if specs.belongs(pod, r))
        runs.setdefault(run, []).append(pod)
    if not runs:
        out.write("no runs: `podagent up` starts one\n")
        _list_volumes(volumes, out)
        return 0
    now = time.time()
    billing = 0
    rows = [("run / pod", "id", "status", "$/h", "cost")]
    total_rate = total_cost = 0.0
    for run, its_pods in sorted(runs.items()):
        record = records.get(run)
        told = record.status if record else "no local record"
        if record and record.outcome and "code" in record.outcome:
            told += f" (exit {record.outcome['code']})"
        if record and record.replacements:
            told += f", {len(record.replacements)} lost pod(s) replaced"
        rate = sum(float(p.get("cost") or 0.0) for p in its_pods)
        spent = ((record.cost or {}).get("dollars") if record and record.cost else None)
        spent = float(spent) if isinstance(spent, (int, float)) else sum(
            _billed_so_far(p, now) for p in its_pods)
        total_rate += rate
        total_cost += spent
        rows.append((run, "", f"{told}, {len(its_pods)} pod(s)", f"{rate:.2f}",
                     f"${spent:.2f}"))
        for pod in sorted(its_pods, key=lambda p: str(p.get("name"))):
            billing += pod.get("status") in BILLING_STATUSES
            rows.append((f"  {pod.get('name')}", str(pod.get("id")), str(pod.get("status")),
                         f"{float(pod.get('cost') or 0.0):.2f}",
                         f"${_billed_so_far(pod, now):.2f}"))
    rows.append(("total", "", f"{billing} pod(s) billing", f"{total_rate:.2f}",
                 f"${total_cost:.2f}"))
    _write_table(rows, out)
    _list_volumes(volumes, out)
    return billing


def _write_table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
                  + "\n")


def _list_volumes(volumes: list[dict[str, Any]], out: TextIO) -> None:
    """The runs' network volumes, kept after their pods: what each costs a month."""
    if not volumes:
        return
    rows = [("network volume", "id", "GB", "data center", "$/month")]
    monthly = 0.0
    for volume in sorted(volumes, key=lambda v: str(v["name"])):
        price = specs.volume_price(int(volume["size"]))
        monthly += price
        rows.append((str(volume["name"]), str(volume["id"]), str(volume["size"]),
                     str(volume["dataCenter"]), f"${price:.2f}"))
    rows.append(("total", "", str(sum(int(v["size"]) for v in volumes)), "",
                 f"${monthly:.2f}"))
    out.write("\n")
    _write_table(rows, out)
    out.write("`podagent down RUN --volume` deletes a run's volume (its checkpoints and "
              "model)\n")


def environ() -> Mapping[str, str]:
    return os.environ
