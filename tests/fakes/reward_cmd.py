"""A reward server of the user's own (PODAGENT_REWARD=cmd) for tests: it scores every query
1.0 on the host and port the head gives it, after what `before` does (wait for a file, ignore
SIGTERM...)."""

from __future__ import annotations

import textwrap

_SERVER = """
import http.server, json, os, signal, sys, time

{before}

class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = json.dumps({{"rewards": [1.0] * len(body["query"])}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

host, port = os.environ["PODAGENT_REWARD_HOST"], int(os.environ["PODAGENT_REWARD_PORT"])
http.server.ThreadingHTTPServer((host, port), Handler).serve_forever()
"""


def script(before: str = "") -> str:
    """The server's source; `before` runs first (module level, with os, signal, sys and time
    imported)."""
    return _SERVER.format(before=textwrap.dedent(before).strip())
