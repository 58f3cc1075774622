"""The reward bench's other servers, each started as a process of its own by bench/reward.py.

* `zero`: answers every request at once, a zero per item (`rewards`, `scores`,
  `format_rewards`, `acc_rewards`), after reading its body and its JSON as any server must.
  Several processes share the port (SO_REUSEPORT), each on uvloop where installed, so that on
  any machine it answers faster than one client process can send: a client measured against it
  runs at its own ceiling, which is what the other servers' per-sample rates are given as a
  fraction of.
* `seed`: OpenRLHF-M's own reward server (`openrlhf/models/remote_rm/math_verifier.py` of a
  checkout the user names), run unmodified: its `__main__` runs as written, with its own
  arguments; only the address its `app.run` binds (0.0.0.0:5000, written in the file) is
  replaced by loopback and a free port, so that it can run beside the others.

    python bench/_reward_servers.py zero --port P [--processes N]
    python bench/_reward_servers.py seed --port P --source DIR --dataset FILE
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import runpy
import signal
import socket
import sys
from pathlib import Path

SEED_SERVER = Path("openrlhf/models/remote_rm/math_verifier.py")


def seed_server_file(checkout: str) -> Path:
    """The seed's server in a checkout of OpenRLHF-M (or the file itself)."""
    path = Path(checkout)
    return path if path.is_file() else path / SEED_SERVER


# --- zero ---------------------------------------------------------------------------------------


def _zero_app():
    from aiohttp import web

    async def get_reward(request: web.Request) -> web.Response:
        data = json.loads(await request.read())
        zeros = [0.0] * len(data["query"])
        return web.json_response({"rewards": zeros, "scores": zeros, "format_rewards": zeros,
                                  "acc_rewards": zeros})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/get_reward", get_reward)
    app.router.add_get("/health", health)
    return app


def _zero_process(sock: socket.socket) -> None:
    from aiohttp import web

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(_zero_app(), sock=sock, print=None, access_log=None, handle_signals=True)


def serve_zero(port: int, processes: int) -> None:
    # One listening socket, bound here and inherited: every process accepts from it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_zero_process, args=(sock,), daemon=True)
                for _ in range(processes)]
    for child in children:
        child.start()

    def stop(*_: object) -> None:
        for child in children:
            child.terminate()
        for child in children:
            child.join(10)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for child in children:
        child.join()
    stop()


# --- seed ---------------------------------------------------------------------------------------


def serve_seed(port: int, source: str, dataset: str, template: str, log_file: str) -> None:
    import flask

    path = seed_server_file(source)
    run = flask.Flask.run

    def on_loopback(self, *_, **kwargs):  # its own other arguments kept
        kwargs.update(host="127.0.0.1", port=port)
        return run(self, **kwargs)

    flask.Flask.run = on_loopback  # type: ignore[method-assign]
    sys.argv = [str(path), "--dataset", dataset, "--prompt-template", template,
                "--log_file", log_file]
    runpy.run_path(str(path), run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("zero", "seed"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--processes", type=int, default=max(2, (os.cpu_count() or 1) // 4))
    parser.add_argument("--source", help="seed: a checkout of OpenRLHF-M (or its server file)")
    parser.add_argument("--dataset", help="seed: the dataset (jsonl of prompt and answer)")
    parser.add_argument("--template", default="chatml", help="seed: its --prompt-template")
    parser.add_argument("--log-file", default=os.devnull, help="seed: its --log_file")
    args = parser.parse_args()
    if args.kind == "zero":
        serve_zero(args.port, args.processes)
    else:
        serve_seed(args.port, args.source, args.dataset, args.template, args.log_file)


if __name__ == "__main__":
    main()
