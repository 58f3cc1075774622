"""`podagent up`'s CHECKING and CREATING: the run's spec against RunPod's catalogs (the GPU
type's id, the data centers that suit it, the registry credential), what of the run exists
already, and then whatever is missing created: the head first, then the workers with its id,
CREATES_AT_ONCE at a time; or one cluster. Each create is recorded before its call goes out,
so `podagent down` finds it whatever happens next."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from podagent.errors import InputError, NoCapacity, PodsNotReady, RunPodApiError
from podagent.launch import down, interrupts, state
from podagent.launch import spec as specs
from podagent.launch.spec import Placement, UpSpec
from podagent.launch.view import Board, View
from podagent.platform.runpod_api import Client

CREATES_AT_ONCE = 8  # workers created in parallel once the head's id is known


@dataclass
class Checked:
    """What CHECKING found: where and how to create, the run's record, and what exists."""
    placement: Placement
    record: state.RunRecord
    spec: UpSpec  # the run's, its deadline worked out (specs.capped)
    pod_ids: dict[str, str] = field(default_factory=dict)  # name -> id, found at RunPod
    cluster_id: str | None = None
    volume: dict[str, Any] | None = None  # the run's network volume, found at RunPod
    volume_data_center: str | None = None  # where a new one goes (the pods with it)

    @property
    def exists(self) -> bool:
        return bool(self.pod_ids) or self.cluster_id is not None


def check(spec: UpSpec, client: Client, follow_only: bool,
          say: Callable[[str], None]) -> Checked:
    gpu = specs.check_gpu(spec, client.gpu_types())
    catalog = client.data_centers(gpu_availability=spec.shared_volume_gb is not None)
    data_centers = specs.check_data_centers(spec, catalog)
    registry = specs.check_registry(spec, client.registries()) if spec.registry_auth else None
    # The record is a hint: one that cannot be read is set aside, and the run's pods are
    # found at RunPod by their names and label all the same.
    record = state.load_hint(spec.state_dir, spec.run, say)
    found = down.find(client, spec.run, record)
    alive = [p for p in found.pods if p.get("status") != "TERMINATED"]
    if follow_only and not found:
        told = (record.outcome or {}) if record is not None else {}
        raise PodsNotReady(f"run {spec.run}: nothing of it at RunPod" + (
            f" (its record here: {record.status}"
            + (f", exit {told['code']}" if "code" in told else "") + ")"
            if record is not None else ", and no record of it here"))
    # The cap counts from here, before anything is created: the deadline the pods hold (a
    # run that exists keeps its own, from its record or its pods). Worked out before a new
    # record is written: a cap refused leaves none behind.
    price = specs.price_per_hour(spec, gpu)
    now = time.time()
    kept = (record.spec or {}).get("deadline") if found and record is not None else None
    held = (float(kept) if isinstance(kept, (int, float)) and not isinstance(kept, bool)
            else specs.deadline_of(alive))
    asked = spec.max_duration is not None or spec.max_cost is not None
    if alive and held is None and not follow_only and asked:
        raise InputError(f"run {spec.run} exists at RunPod without a cap, and its pods cannot "
                         f"be given one now (--max-duration/--max-cost cap a run as it is "
                         f"created): `podagent down {spec.run}` first, or leave the cap out")
    spec, cap_line = specs.capped(spec, price, now, held)
    if alive and not follow_only and spec.deadline is not None and spec.deadline <= now:
        raise InputError(f"run {spec.run} passed its deadline ({specs.utc(spec.deadline)}): "
                         f"nothing more is created for it; `podagent up --name {spec.run}` "
                         f"follows it to its end, `podagent down {spec.run}` terminates it")
    if held is not None and asked:
        cap_line += " (the run's own cap: the one given now is not used)"
    if record is None or (record.status == state.DOWN and not found):
        # No record here (deleted, set aside, or the run started on another machine): a new
        # one, also when re-attaching to pods that exist, so that `ls` and `down` know them.
        record = state.new(spec.state_dir, spec.run, spec.api_url, spec.shape(),
                           spec.to_record())
    elif spec.deadline is not None and (record.spec or {}).get("deadline") != spec.deadline:
        record.spec = {**(record.spec or spec.to_record()), "deadline": spec.deadline}
        record.try_save()
    checked = Checked(Placement(str(gpu["id"]), data_centers, registry), record, spec,
                      {str(p["name"]): str(p["id"]) for p in alive},
                      str(found.clusters[0]["id"]) if found.clusters else None)
    if spec.shared_volume_gb is not None:
        _place_volume(checked, client, catalog, say)
    elif spec.network_volume is None and spec.pods > 1 and not follow_only:
        say("WARNING: no network volume (--volume, or --no-shared-volume): the checkpoints "
            "and the model die with the pods when the run ends, and a lost pod's replacement "
            "cannot resume from them")
    if checked.exists:
        say(f"run {spec.run} exists at RunPod ({len(alive)} pod(s)): re-attaching to it"
            + ("" if follow_only else ", creating only what is missing"))
        if follow_only and record.status == state.CREATING:  # the new record above
            record.try_mark(state.RUNNING)
    priced = f" at about ${price:.2f}/h (RunPod's list price)" if price is not None else ""
    placed = checked.placement.data_centers  # (the volume's, when the run has one)
    where = f" in {', '.join(placed)}" if placed else ""
    say(f"run {spec.run}: {spec.shape()}{priced}{where}; state in "
        f"{state.path_of(spec.state_dir, spec.run)}")
    if cap_line:
        say(cap_line)
    return checked


def _place_volume(checked: Checked, client: Client, catalog: list[Mapping[str, Any]],
                  say: Callable[[str], None]) -> None:
    """The run's network volume: the one it has at RunPod (by the record's id or its name;
    a run created again uses its results), else where a new one goes: a data center the
    pods may go to (any, for a cluster given none) that offers network volumes, those where
    the catalog says the GPU type is available first, the most available first (RunPod
    places a pod in its volume's data center)."""
    spec, record = checked.spec, checked.record
    name = specs.volume_name(spec.run)
    known = set(record.ids("volume"))
    checked.volume = next((v for v in client.network_volumes()
                           if v["id"] in known or v["name"] == name), None)
    allowed = set(checked.placement.data_centers)
    if checked.volume is not None:
        where, size = checked.volume["dataCenter"], int(checked.volume["size"])
        if allowed and where not in allowed:
            raise InputError(f"run {spec.run}'s network volume {checked.volume['id']} is in "
                             f"{where}, where its pods may not go (--data-center; or "
                             f"`podagent down {spec.run} --volume` deletes it)")
        checked.placement = dataclasses.replace(checked.placement, data_centers=(where,))
        say(f"run {spec.run} has its network volume at RunPod ({checked.volume['id']}, "
            f"{size} GB in {where}): every pod mounts it at /workspace")
        if spec.shared_volume_gb is not None and size < spec.shared_volume_gb:
            say(f"WARNING: run {spec.run}'s network volume is {size} GB, less than the "
                f"{spec.shared_volume_gb} GB this run asks for (--shared-volume, or worked out "
                f"from its model): it is used as it is; grow it at RunPod, or `podagent down "
                f"{spec.run} --volume` first for a new one")
        return
    gpu = checked.placement.gpu_id
    offered = [dc for dc in catalog if (not allowed or str(dc.get("id")) in allowed)
               and dc.get("networkVolumeTypes")]

    def availability(dc: Mapping[str, Any]) -> int:
        levels = {str(a.get("id")): a.get("availability")
                  for a in dc.get("gpuAvailability") or [] if isinstance(a, dict)}
        return -{"HIGH": 3, "MEDIUM": 2, "LOW": 1}.get(str(levels.get(gpu)), 0)

    offered.sort(key=availability)  # stable: the catalog's order among equals
    if not offered:
        among = f" ({', '.join(sorted(allowed))})" if allowed else ""
        raise InputError(f"no data center the run's pods may go to{among} offers network "
                         f"volumes in RunPod's catalog: give --data-center one that does, or "
                         f"--no-shared-volume (the checkpoints and the model then die with "
                         f"the pods)")
    checked.volume_data_center = str(offered[0]["id"])
    checked.placement = dataclasses.replace(checked.placement,
                                            data_centers=(checked.volume_data_center,))


class Creator:
    """Creates what the run lacks. `created` is set before the first call goes out: from then
    on something may exist at RunPod, and the run's end must terminate it."""

    def __init__(self, spec: UpSpec, client: Client, checked: Checked, board: Board,
                 view: View):
        self.spec, self.client, self.checked = spec, client, checked
        self.board, self.view = board, view
        self.created = False
        # Every create is a call on this pool, never on the main thread: a signal then stops
        # only the waiting, and an answer that comes after it is still read (see wait).
        self._pool = concurrent.futures.ThreadPoolExecutor(CREATES_AT_ONCE,
                                                           thread_name_prefix="create")
        self._calls: dict[concurrent.futures.Future[Mapping[str, Any]],
                          tuple[state.Resource, str]] = {}

    def create(self) -> None:
        spec, placement = self.spec, self.checked.placement
        try:
            if spec.shared_volume_gb is not None and self.checked.volume is None:
                self._volume()
            if self.checked.volume is not None:  # every pod mounts it
                spec = self.spec = dataclasses.replace(
                    spec, network_volume=str(self.checked.volume["id"]))
            if spec.cluster:
                self._cluster()
            else:
                self._pods()
        except NoCapacity as exc:
            where = ", ".join(spec.data_centers) or "any data center"
            raise NoCapacity(f"RunPod could not place {spec.gpus_per_pod} x "
                             f"{placement.gpu_id} ({spec.cloud} cloud) in {where}: {exc}"
                             ) from None
        self.checked.record.mark(state.RUNNING)

    def _volume(self) -> None:
        """The run's network volume created (recorded before the call, as every create), in
        the data center CHECKING chose: its results outlive the pods."""
        spec, record = self.spec, self.checked.record
        name = specs.volume_name(spec.run)
        asked = record.asking("volume", name, None, spec.api_timeout)
        self.created = True
        body = {"name": name, "size": spec.shared_volume_gb,
                "dataCenter": self.checked.volume_data_center}
        volume = interrupts.result(self._call(asked, name, functools.partial(
            self.client.create_network_volume, body, functools.partial(record.resent, asked))))
        self._record(asked, name, str(volume["id"]))
        self.checked.volume = dict(volume)
        self.view.line(f"[up] created network volume {name} ({volume['id']}, {volume['size']} GB "
                       f"in {volume['dataCenter']}, about "
                       f"${specs.volume_price(int(volume['size'])):.2f}/month): every pod "
                       f"mounts it at /workspace; it is kept after the run")

    def wait(self) -> None:
        """Creates still on their way finish first: a pod created after the clean-up looked
        would outlive it (each call has its own deadline). Their answers, and those that came
        while nobody listened (a signal, another create's failure), are recorded: the clean-up
        then knows those pods' ids and waits for no create to land. A create that never went
        out made nothing."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        record = self.checked.record
        for call, (asked, name) in self._calls.items():
            if asked.id is not None:
                continue
            if call.cancelled():
                record.refused(asked)
            elif call.exception() is None and call.result().get("id"):
                # (An answer without an id stays asked: the clean-up looks for it by name;
                # nothing here may raise, or the clean-up after it would not run.)
                self._record(asked, name, str(call.result()["id"]))
                if asked.kind == "volume":  # the run's end keeps it, or deletes it
                    self.checked.volume = dict(call.result())

    def _record(self, asked: state.Resource, name: str, made: str) -> None:
        """What RunPod made for an asked create: in the record and in what the run holds."""
        self.checked.record.got(asked, made)
        if asked.kind == "pod":
            self.checked.pod_ids[name] = made
        elif asked.kind == "cluster":
            self.checked.cluster_id = made

    def _pods(self) -> None:
        spec, checked, record = self.spec, self.checked, self.checked.record
        pod_ids, placement = checked.pod_ids, checked.placement
        head_name = specs.pod_name(spec.run, 0)
        if head_name not in pod_ids and pod_ids:
            raise PodsNotReady(f"run {spec.run} has workers at RunPod but no head (it was "
                               f"terminated): they are terminated too; up again starts the "
                               f"run afresh")
        if head_name not in pod_ids:
            asked = record.asking("pod", head_name, 0, spec.api_timeout)
            self.created = True  # from the moment the call may go out
            create = functools.partial(self.client.create_pod,
                                       specs.pod_body(spec, 0, None, placement),
                                       functools.partial(record.resent, asked))
            self._got(asked, head_name,
                      interrupts.result(self._call(asked, head_name, create)))
        head_id = pod_ids[head_name]
        missing = [(rank, name) for rank, name in enumerate(spec.names())
                   if rank and name not in pod_ids]
        if not missing:
            return
        # Every intent on disk before any of the calls goes out; then the calls at once.
        asking = {name: record.asking("pod", name, rank, spec.api_timeout)
                  for rank, name in missing}
        self.created = True
        calls = {self._call(asking[name], name, functools.partial(
            self.client.create_pod, specs.pod_body(spec, rank, head_id, placement),
            functools.partial(record.resent, asking[name]))): name
            for rank, name in missing}
        for done in interrupts.as_completed(calls):
            name = calls[done]
            self._got(asking[name], name, done.result())  # the first failure ends it

    def replace(self, name: str, lost: str) -> None:
        """Worker `name` created again in place of pod `lost` (terminated): the same body as
        its first create (image, GPU, env, secrets, volume, the head's id), its create
        recorded before it goes out, as every create is; a lookup after a lost answer never
        takes the lost pod for it."""
        spec, checked = self.spec, self.checked
        rank = spec.names().index(name)
        head_id = checked.pod_ids[specs.pod_name(spec.run, 0)]
        checked.pod_ids.pop(name, None)
        asked = checked.record.asking("pod", name, rank, spec.api_timeout)
        self.created = True
        create = functools.partial(self.client.create_pod,
                                   specs.pod_body(spec, rank, head_id, checked.placement),
                                   functools.partial(checked.record.resent, asked), {lost})
        self._got(asked, name, interrupts.result(self._call(asked, name, create)))

    def _call(self, asked: state.Resource, name: str, create: Callable[[], dict[str, Any]]
              ) -> concurrent.futures.Future[Mapping[str, Any]]:
        call = self._pool.submit(self._answered, asked, create)
        self._calls[call] = (asked, name)
        return call

    def _answered(self, asked: state.Resource,
                  create: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A create's answer; one RunPod refused is recorded so (nothing was made, so the
        clean-up does not wait for it to land), one that never came is left as asked."""
        try:
            return create()
        except RunPodApiError as exc:
            if exc.answered:
                self.checked.record.refused(asked)
            raise

    def _got(self, asked: state.Resource, name: str, pod: Mapping[str, Any]) -> None:
        self._record(asked, name, str(pod["id"]))
        row = self.board.row(name)
        row.show(pod)
        row.id = str(pod["id"])
        self.view.update(self.board)

    def _cluster(self) -> None:
        if self.checked.cluster_id is None:
            record = self.checked.record
            name = specs.cluster_name(self.spec.run)
            asked = record.asking("cluster", name, None, self.spec.api_timeout)
            self.created = True
            cluster = interrupts.result(self._call(asked, name, functools.partial(
                self.client.create_cluster,
                specs.cluster_body(self.spec, self.checked.placement),
                functools.partial(record.resent, asked))))
            self._record(asked, name, str(cluster["id"]))
