"""RunPod pods as containers of the built image: one Docker network, one container per pod with
its own RUNPOD_POD_ID, the RunPod template's environment, a volume at /workspace, an interface
named podnet1 (podnet_runtime.py) and a real DNS server answering `<id>.runpod.internal`.

What the harness gives a pod is what RunPod gives one: the template's env (secret references
filled in), RUNPOD_POD_ID and RUNPOD_GPU_COUNT, the pod's DNS name, its volume. Everything else
comes from the image: ENTRYPOINT (tini, the script), ENV, HEALTHCHECK.

Plain module (no pytest import) so benchmarks can use it. Secrets never reach a command line:
each container's environment goes to docker in an --env-file (mode 0600, removed once the
container is created).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.container.engine import STATE_DIR, images
from tests.harness.pods import RUNPOD_ZONE, DnsServer, random_pod_id, run_cmd, wait_for
from tests.unit.test_container import SECRET_REFERENCE, TEMPLATE

LABEL = "podagent.test"  # on everything the harness creates; the value is the session's token
SUPERNET = ipaddress.IPv4Network("10.214.0.0/16")  # tests/e2e takes 10.213.0.0/16
INTERFACE = "podnet1"
POLL = 0.5


def template_env(token: str, wandb_key: str) -> dict[str, str]:
    """The RunPod template's env as a pod gets it: secret references filled in by RunPod."""
    fills = {"PODAGENT_TOKEN": token, "WANDB_API_KEY": wandb_key}
    env = {}
    for key, value in json.loads(TEMPLATE.read_text())["env"].items():
        if SECRET_REFERENCE.fullmatch(value):
            value = fills[key]
        env[key] = value
    return env


# --- a session: labels and stale resources -------------------------------------------------------


class Session:
    """Owns a token; holds a lock file while alive so that cleanup_stale() of another run never
    removes its containers, and removes a crashed run's leftovers."""

    def __init__(self, docker: images.Docker):
        self.docker = docker
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(4)
        self._lock = os.open(STATE_DIR / f"session-{self.token}.lock",
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    @property
    def label(self) -> str:
        return f"{LABEL}={self.token}"

    def close(self) -> None:
        remove_labelled(self.docker, self.label)
        os.close(self._lock)
        with contextlib.suppress(FileNotFoundError):
            (STATE_DIR / f"session-{self.token}.lock").unlink()

    def cleanup_stale(self) -> list[str]:
        """Remove what runs that are gone left behind (their lock is free)."""
        stale = []
        for path in STATE_DIR.glob("session-*.lock"):
            token = path.stem.removeprefix("session-")
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive
            finally:
                os.close(fd)
            stale += remove_labelled(self.docker, f"{LABEL}={token}")
            path.unlink()
        return stale


def remove_labelled(docker: images.Docker, label: str) -> list[str]:
    removed = []
    for kind, listing, remove in (
            ("container", ["ps", "--all", "--quiet"], ["rm", "--force", "--volumes"]),
            ("network", ["network", "ls", "--quiet"], ["network", "rm"]),
            ("volume", ["volume", "ls", "--quiet"], ["volume", "rm", "--force"])):
        ids = docker(*listing, "--filter", f"label={label}").stdout.split()
        if ids:
            docker(*remove, *ids, timeout=120)
            removed += [f"{kind} {i}" for i in ids]
    return removed


# --- the network -------------------------------------------------------------------------------


def _used_networks() -> list[ipaddress.IPv4Network]:
    routes = json.loads(run_cmd(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    return [ipaddress.IPv4Network(r["dst"], strict=False) for r in routes
            if r.get("dst", "default") != "default"]


class PodNet:
    """A Docker bridge network for pods, and the DNS server for runpod.internal on its gateway
    (port 53: the pods use their system resolver, as on RunPod)."""

    def __init__(self, session: Session):
        self.session = session
        self.docker = session.docker
        self.name = f"podagent-{session.token}-{secrets.token_hex(2)}"
        self.subnet = self._create()
        hosts = list(self.subnet.hosts())
        self.gateway = str(hosts[0])
        self._free = [str(h) for h in hosts[1:]]
        self.dns = DnsServer(address=self.gateway, port=53).start()

    def _create(self) -> ipaddress.IPv4Network:
        used = _used_networks()
        for net in SUPERNET.subnets(new_prefix=24):
            if any(net.overlaps(u) for u in used):
                continue
            proc = self.docker("network", "create", "--driver", "bridge",
                               "--subnet", str(net), "--gateway", str(next(net.hosts())),
                               "--label", self.session.label, self.name, check=False)
            if proc.returncode == 0:
                return net
            if "overlap" not in proc.stderr:
                raise images.BuildError(["docker", "network", "create", self.name],
                                        proc.returncode, proc.stderr)
        raise RuntimeError(f"no free /24 left in {SUPERNET}")

    def address(self) -> str:
        return self._free.pop(0)

    def close(self) -> None:
        self.dns.stop()
        self.docker("network", "rm", self.name, check=False)


# --- pods --------------------------------------------------------------------------------------


class PodContainer:
    """One pod: a container of `image` on `net`, registered in DNS before it starts (RunPod's
    name exists with the pod), with its own named volume at /workspace."""

    def __init__(self, net: PodNet, image: str, name: str, env: Mapping[str, str],
                 pod_id: str | None = None, volume: str | None = None):
        self.net = net
        self.docker = net.docker
        self.image = image
        self.pod_id = pod_id or random_pod_id()
        self.name = f"{net.name}-{name}"
        self.role_name = name
        self.ip = net.address()
        self.volume = volume or self.name
        self.env = {**env, "RUNPOD_POD_ID": self.pod_id, "RUNPOD_GPU_COUNT": "0"}
        self.started_at: float | None = None

    @property
    def dns_name(self) -> str:
        return f"{self.pod_id}.{RUNPOD_ZONE}"

    def start(self, *args: str, entrypoint: Sequence[str] | None = None,
              health_interval: float | None = None) -> PodContainer:
        """`docker run` the image; args are the pod's start command (podagent's arguments).
        health_interval shortens the image's HEALTHCHECK interval (its command, timeout,
        retries and start period stay the image's)."""
        self.docker("volume", "create", "--label", self.net.session.label, self.volume)
        self.net.dns.set_record(self.dns_name, self.ip)
        argv = ["run", "--detach", "--name", self.name, "--hostname", self.pod_id,
                "--label", self.net.session.label, "--runtime", "podnet",
                "--network", self.net.name, "--ip", self.ip, "--dns", self.net.gateway,
                "--volume", f"{self.volume}:/workspace"]
        if health_interval is not None:
            argv += ["--health-interval", f"{health_interval:g}s"]
        if entrypoint:
            argv += ["--entrypoint", entrypoint[0]]
        with tempfile.TemporaryDirectory(prefix="podagent-env-") as folder:
            env_file = Path(folder) / "env"
            fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                for key, value in self.env.items():
                    if "\n" in value:
                        raise ValueError(f"{key}: an --env-file value cannot hold a newline")
                    f.write(f"{key}={value}\n")
            argv += ["--env-file", str(env_file), self.image, *(entrypoint or [])[1:], *args]
            self.started_at = time.monotonic()
            self.docker(*argv, timeout=300)
        return self

    # -- observing ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return json.loads(self.docker("inspect", "--format", "{{json .State}}", self.name).stdout)

    def inspect(self) -> dict[str, Any]:
        (found,) = json.loads(self.docker("inspect", self.name).stdout)
        return found

    @property
    def logs(self) -> str:
        proc = subprocess.run([self.docker.path, "logs", self.name], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=60,
                              stdin=subprocess.DEVNULL, errors="replace")
        return proc.stdout

    def wait_logs(self, text: str, timeout: float) -> None:
        def seen() -> bool:
            if text in self.logs:
                return True
            state = self.state()
            if not state["Running"]:
                raise AssertionError(f"{self.role_name} exited {state['ExitCode']} before "
                                     f"printing {text!r}:\n{self.logs[-3000:]}")
            return False

        try:
            wait_for(seen, timeout=timeout, interval=POLL,
                     what=f"{self.role_name} to print {text!r}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}:\n{self.logs[-3000:]}") from None

    def wait_exit(self, timeout: float) -> int:
        def exited() -> dict[str, Any] | None:
            state = self.state()
            return None if state["Running"] else state

        try:
            state = wait_for(exited, timeout=timeout, interval=POLL,
                             what=f"{self.role_name}'s container to exit")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}:\n{self.logs[-3000:]}") from None
        return int(state["ExitCode"])

    def wait_health(self, status: str, timeout: float) -> dict[str, Any]:
        """Until the HEALTHCHECK reports `status`; the health record then (status, log)."""
        last: dict[str, Any] = {}

        def reached() -> dict[str, Any] | None:
            nonlocal last
            state = self.state()
            last = state.get("Health") or {}
            if not state["Running"]:
                raise AssertionError(f"{self.role_name} exited {state['ExitCode']} while "
                                     f"waiting for health {status!r}; health: {last}")
            return last if last.get("Status") == status else None

        return wait_for(reached, timeout=timeout, interval=POLL,
                        what=f"{self.role_name}'s health to become {status!r}")

    def pids(self) -> list[int]:
        """Host pids of the container's processes (empty once it stopped)."""
        proc = self.docker("top", self.name, "-eo", "pid", check=False)
        if proc.returncode != 0:
            return []
        return [int(tok) for tok in proc.stdout.split()[1:]]

    def cmdlines(self) -> dict[int, list[str]]:
        out = {}
        for pid in self.pids():
            with contextlib.suppress(OSError):
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                out[pid] = raw.decode(errors="replace").split("\0")[:-1]
        return out

    def exec(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.docker("exec", self.name, *argv, timeout=timeout, check=False)

    def read_volume(self) -> dict[str, bytes]:
        """Every file of the pod's volume, read by a fresh container of the same image (this
        pod's container may be gone): path under /workspace -> content."""
        script = ("import base64, json, pathlib\n"
                  "root = pathlib.Path('/workspace')\n"
                  "print(json.dumps({str(p.relative_to(root)): base64.b64encode(p.read_bytes())"
                  ".decode() for p in root.rglob('*') if p.is_file()}))")
        proc = self.docker("run", "--rm", "--network", "none", "--label", self.net.session.label,
                           "--volume", f"{self.volume}:/workspace:ro", "--entrypoint", "python",
                           self.image, "-c", script, timeout=300)
        return {k: base64.b64decode(v) for k, v in json.loads(proc.stdout).items()}

    def remove(self) -> None:
        self.docker("rm", "--force", self.name, check=False, timeout=120)


@contextlib.contextmanager
def pod_net(session: Session) -> Iterator[PodNet]:
    net = PodNet(session)
    try:
        yield net
    finally:
        net.close()
