"""`status`, `stop` and `logs` for a run without Ray (`podagent torchrun/accelerate`): the same
commands ask the head's podagent on its supervisor port where the Ray path asks Ray
(control/channel.py chooses)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from podagent.config import Settings
from podagent.control.lookup import HTTP_TIMEOUT
from podagent.errors import StopTimeout
from podagent.gang import mesh
from podagent.waiting import Signals

FOLLOW_EVERY = 1.0  # `logs --follow` asks for more this often


def ask(settings: Settings, ip: str, question: dict[str, Any]) -> tuple[mesh.Wire, Any] | None:
    """The head's answer, on the still open connection; None when no run without Ray answers
    there (nothing listens on the supervisor port, something else does, or the head cannot be
    reached: the Ray path then asks, and says what it finds). A head that refuses the cluster
    token raises HeadUnreachable."""
    try:
        return mesh.ask(ip, settings.supervisor_port, question, settings.auth_token,
                        HTTP_TIMEOUT)
    except OSError:
        return None
    except mesh.NotSupervisor:
        return None


def answers(settings: Settings, ip: str) -> bool:
    """Whether a run without Ray answers on the head's supervisor port."""
    asked = ask(settings, ip, {"ask": "status"})
    if asked is not None:
        asked[0].close()
    return asked is not None


def status(settings: Settings, ip: str) -> dict[str, Any] | None:
    asked = ask(settings, ip, {"ask": "status"})
    if asked is None:
        return None
    wire, answer = asked
    wire.close()
    return {**answer, "head": {"ip": ip, "supervisor": f"{ip}:{settings.supervisor_port}"}}


def render(state: dict[str, Any]) -> str:
    lines = [f"run {state['run']} without Ray ({state['launcher']}), head's podagent at "
             f"{state['head']['supervisor']}, up {state['uptime_s'] / 60:.1f} min",
             f"{state['phase']}" + (f": {state['step']}" if state.get("step") else "")
             + f", {state['nodes']} node(s)"]
    quiet, hangs = state.get("quiet_s"), state.get("hangs") or 0
    if quiet is not None or hangs:
        said = [f"last progress {quiet:g} s ago" if quiet is not None else "not watched now"]
        if hangs:
            said.append(f"{hangs} hang(s) in this start (stacks in the run's hangs/ on each "
                        f"pod)")
        lines.append("; ".join(said))
    for pod in state["pods"]:
        heard = "" if pod["role"] == "head" else f", heard {pod['silent_s']:g} s ago"
        lines.append(f"  machine {pod['rank']}  {pod['addr']:<15} {pod['role']:<6} "
                     f"{pod['pod']}  {pod['state']}{heard}")
    return "\n".join(lines)


def stop(settings: Settings, ip: str, by: str, timeout: float) -> float | None:
    """Ask the head to end the run, then wait until it says every pod is out; seconds taken,
    or None when no run without Ray is there."""
    started = time.monotonic()
    asked = ask(settings, ip, {"ask": "stop", "by": by})
    if asked is None:
        return None
    wire, _ = asked
    try:
        answer = wire.next(timeout)
    finally:
        wire.close()
    if answer is TimeoutError:
        raise StopTimeout(f"the run at {ip} was still going {timeout:g} s after the stop "
                          f"request (`podagent status` shows its pods)")
    if isinstance(answer, dict) and isinstance(answer.get("stopped"), dict):
        left = answer["stopped"].get("left") or []
        if left:
            raise StopTimeout(f"the run at {ip} ended, but these pods' podagents did not "
                              f"leave in time: {', '.join(map(str, left))}")
    return time.monotonic() - started


def follow(settings: Settings, ip: str, follow_on: bool, write: Callable[[str], None],
           signals: Signals) -> bool:
    """Print the head's training log (the launcher's output on the head: rank 0's); with
    follow, until the run is over. False when no run without Ray is there."""
    offset = 0
    while True:
        asked = ask(settings, ip, {"ask": "logs", "offset": offset})
        if asked is None:  # after some of the log: the head's podagent has gone, the run is over
            return bool(offset)
        wire, answer = asked
        wire.close()
        text = answer.get("text", "") if isinstance(answer, dict) else ""
        if text:
            write(text)
            offset = int(answer.get("offset", offset + len(text.encode())))
            continue
        if not follow_on or answer.get("over"):
            return True
        signals.sleep(FOLLOW_EVERY)
