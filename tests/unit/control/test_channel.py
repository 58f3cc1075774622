"""The asking commands' channel is chosen in one place: a head whose supervisor port answers
runs without Ray; anything else is asked through Ray."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import podagent
from podagent import config
from podagent.control import channel
from podagent.platform.roles import Role
from tests.unit.gang.test_mesh import _free_port, _reporter
from tests.unit.gang.test_mesh_hostile import _running


def _settings(port: int) -> config.Settings:
    return config.build({}, {"PODAGENT_NODE_IP": "127.0.0.1",
                             "PODAGENT_SUPERVISOR_PORT": str(port)})


def test_a_head_whose_supervisor_answers_is_asked_on_its_port():
    hub, *_, links, _ = _running(token=None)
    port = hub.rv.port
    hub.status = lambda: {"run": "r", "launcher": "torchrun", "uptime_s": 6.0,
                          "phase": "running", "nodes": 2, "pods": []}
    try:
        chosen = channel.open_channel(_settings(port), Role.HEAD, _reporter("head"))
        assert isinstance(chosen, channel.SupervisorChannel)
        state = chosen.status()
        assert state["run"] == "r" and state["head"]["supervisor"] == f"127.0.0.1:{port}"
        assert chosen.render(state).startswith("run r without Ray (torchrun)")
    finally:
        for link in links:
            link.close()
        hub.close()


def test_a_head_without_a_supervisor_is_asked_through_ray():
    port = _free_port()  # nothing listens there
    chosen = channel.open_channel(_settings(port), Role.HEAD, _reporter("head"))
    assert isinstance(chosen, channel.RayChannel)


def test_something_else_on_the_port_is_no_run_without_ray():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(5)

        def greet_wrongly() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b'{"hello": "not a supervisor"}\n')

        thread = threading.Thread(target=greet_wrongly, daemon=True)
        thread.start()
        chosen = channel.open_channel(_settings(port), Role.HEAD, _reporter("head"))
        thread.join(5)
    assert isinstance(chosen, channel.RayChannel)


def test_the_cli_chooses_no_channel_itself():
    cli = (Path(podagent.__file__).parent / "cli.py").read_text()
    assert "no_ray" not in cli and "RayChannel" not in cli and "SupervisorChannel" not in cli
