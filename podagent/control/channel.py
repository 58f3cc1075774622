"""How the asking commands reach a run: one interface, two channels, chosen in one place.

A Ray run is asked through its head's Ray (the GCS key-value store and the Jobs API); a run
without Ray (`podagent torchrun/accelerate`) through its head's supervisor port. `open_channel`
finds the head and picks the channel by asking the supervisor port first (a refused connect is
immediate), so the CLI only parses options and calls one of these methods.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from podagent.config import Settings
from podagent.control import logs as logs_mod
from podagent.control import no_ray
from podagent.control import status as status_mod
from podagent.control import stop as stop_mod
from podagent.errors import HeadUnreachable
from podagent.platform import discovery
from podagent.platform.roles import Role
from podagent.ray_access import ray_compat
from podagent.report import Reporter
from podagent.waiting import Signals

Write = Callable[[str], None]


class Channel(abc.ABC):
    """The questions every run answers, whatever runs its job."""

    def __init__(self, settings: Settings, role: Role, reporter: Reporter, ip: str) -> None:
        self.settings = settings
        self.role = role
        self.reporter = reporter
        self.ip = ip

    @abc.abstractmethod
    def status(self) -> dict[str, Any]:
        """The run as its head sees it (the JSON of `status --json`)."""

    @abc.abstractmethod
    def render(self, state: dict[str, Any]) -> str:
        """`status` for a person."""

    @abc.abstractmethod
    def stop(self, by: str, timeout: float) -> str:
        """End the run and wait until it is down; the line that says so."""

    @abc.abstractmethod
    def logs(self, follow: bool, write: Write, signals: Signals) -> None:
        """Print the run's log; with follow, until the run is over."""


class SupervisorChannel(Channel):
    """A run without Ray: JSON lines with its head's podagent on the supervisor port."""

    def status(self) -> dict[str, Any]:
        state = no_ray.status(self.settings, self.ip)
        if state is None:
            raise _gone(self.ip, self.settings)
        return state

    def render(self, state: dict[str, Any]) -> str:
        return no_ray.render(state)

    def stop(self, by: str, timeout: float) -> str:
        took = no_ray.stop(self.settings, self.ip, by, timeout)
        if took is None:
            raise _gone(self.ip, self.settings)
        return f"every pod of the run is out ({took:.1f} s)"

    def logs(self, follow: bool, write: Write, signals: Signals) -> None:
        if not no_ray.follow(self.settings, self.ip, follow, write, signals):
            raise _gone(self.ip, self.settings)


class RayChannel(Channel):
    """A Ray run: its head's GCS and Jobs API."""

    def __init__(self, settings: Settings, role: Role, reporter: Reporter, ip: str) -> None:
        ray_compat.require()  # the Ray path needs Ray's client here; say so in one line
        super().__init__(settings, role, reporter, ip)

    def status(self) -> dict[str, Any]:
        return status_mod.cluster_status(self.settings, self.role, self.reporter, self.ip)

    def render(self, state: dict[str, Any]) -> str:
        return status_mod.render_status(state)

    def stop(self, by: str, timeout: float) -> str:
        took = stop_mod.request_stop(self.settings, self.role, self.reporter, by=by,
                                     timeout=timeout, ip=self.ip)
        return f"the cluster is down ({took:.1f} s)"

    def logs(self, follow: bool, write: Write, signals: Signals) -> None:
        logs_mod.follow_logs(self.settings, self.role, self.reporter, follow, write, signals,
                             self.ip)


def open_channel(settings: Settings, role: Role, reporter: Reporter) -> Channel:
    """The head found, and the channel its run answers on."""
    ip = discovery.head_ip_now(settings, role, reporter)
    kind = SupervisorChannel if no_ray.answers(settings, ip) else RayChannel
    return kind(settings, role, reporter, ip)


def _gone(ip: str, settings: Settings) -> HeadUnreachable:
    return HeadUnreachable(f"the head's podagent at {ip}:{settings.supervisor_port} stopped "
                           f"answering (the run is over or its head is gone)")
