#!/usr/bin/env python3
"""Base images that stand in for trainers' images, and podagent's image built on each.

No image registry is needed: the bases are made from Debian's packages (debootstrap, then
`docker import`) and PyPI (a CPU torch wheel, the stack's pins). Each base is cached by the
hash of everything that goes into it, so a second run finds it and builds nothing; podagent's
image is then built from the repository's Dockerfile with `--build-arg BASE_IMAGE=<base>`.

    python docker/images.py                    # every base, podagent's image on each
    python docker/images.py --base openrlhf    # one of them
    python docker/images.py --no-cache --json  # podagent's image from scratch; JSON figures

Needs root (debootstrap), a running Docker engine, and a docker client that builds with BuildKit
(the Dockerfile uses `COPY --chmod`). Builds use the host's network: PyPI and Debian's mirror.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_DOCKERFILE = Path(__file__).resolve().parent / "base.Dockerfile"

# Debian bookworm has Python 3.11. minbase plus what a trainer image has: Python with venv, and
# CA certificates.
DEBIAN = {"suite": "bookworm", "mirror": "http://deb.debian.org/debian", "variant": "minbase",
          "include": ["python3", "python3-venv", "ca-certificates"]}
# What Debian's and Ubuntu's official images (the bases of trainers' images) carry, so that apt
# keeps no package caches in a layer; made as their build scripts make it.
APT_DOCKER_CLEAN = (
    'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
    '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
    'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
    '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
    'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n')
ROOTFS_REPO = "podagent-rootfs"
BASE_REPO = "podagent-base"
IMAGE_REPO = "podagent"
IMAGE_LABEL = "podagent.image=test"  # on podagent's images built here (for pruning replaced ones)

# Never a bare `torch`: PyPI's default build pulls several GB of CUDA packages. The `+cpu` build
# comes from the pip configuration of the machine (a local wheel, or PyTorch's CPU index given as
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
TORCH = "torch==2.13.0+cpu"


@dataclasses.dataclass(frozen=True)
class Base:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements besides torch, all pinned


BASES = {
    b.name: b
    for b in (
        Base("openrlhf", "the OpenRLHF / OpenRLHF-M stack: Ray 2.48.0, math-verify 0.5.2",
             ("ray[default]==2.48.0", "math-verify==0.5.2")),
        Base("ray2.60", "Ray 2.60.0, no math-verify", ("ray[default]==2.60.0",)),
    )
}
# What podagent's build must never change in a base (the test asserts every package anyway).
KEPT = ("ray", "torch", "math-verify")


class BuildError(RuntimeError):
    """A command of the build failed: its argv, exit code and the tail of its output."""

    def __init__(self, argv: Sequence[str], code: int, output: str):
        self.argv, self.code, self.output = list(argv), code, output
        tail = "\n".join(output.strip().splitlines()[-40:])
        super().__init__(f"{' '.join(self.argv[:4])} ... exited {code}:\n{tail}")


def run(argv: Sequence[str], *, env: dict[str, str] | None = None, stdin: int | None = None,
        timeout: float = 1800.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})},
                          stdin=subprocess.DEVNULL if stdin is None else stdin)
    if check and proc.returncode != 0:
        raise BuildError(argv, proc.returncode, proc.stdout + proc.stderr)
    return proc


# --- the docker client ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Docker:
    """A docker client that can build with BuildKit; `build_env` is what its builds need."""

    path: str
    build_env: dict[str, str]

    def __call__(self, *args: str, timeout: float = 600.0,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([self.path, *args], timeout=timeout, check=check)

    def image_id(self, ref: str) -> str | None:
        proc = self("image", "inspect", "--format", "{{.Id}}", ref, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    def image_size(self, ref: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", ref).stdout)


def docker_clients() -> list[str]:
    """Every `docker` on PATH, in PATH order (one may be only a client without buildx)."""
    found: list[str] = []
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder, "docker")
        if os.access(path, os.X_OK) and os.path.realpath(path) not in map(os.path.realpath, found):
            found.append(path)
    return found


def find_docker() -> Docker:
    """The first docker client on PATH that builds with BuildKit: one with the buildx plugin, or
    a client older than 23.0 (BuildKit built in, switched on by DOCKER_BUILDKIT=1)."""
    seen = []
    for path in docker_clients():
        if run([path, "buildx", "version"], check=False, timeout=60).returncode == 0:
            return Docker(path, {})
        version = run([path, "version", "--format", "{{.Client.Version}}"], check=False,
                      timeout=60).stdout.strip()
        seen.append(f"{path} {version or '?'}")
        major = re.match(r"(\d+)\.", version)
        if major and int(major[1]) < 23:
            return Docker(path, {"DOCKER_BUILDKIT": "1"})
    raise RuntimeError("no docker client on PATH can build with BuildKit (COPY --chmod needs it): "
                       f"found {seen or 'none'}; install the buildx plugin, or Debian's docker.io")


# --- hashing and contexts ------------------------------------------------------------------------


def digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()[:16]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def host_ca_bundle() -> Path:
    """The CA bundle this machine's pip trusts: PIP_CERT, else the system's OpenSSL default."""
    for candidate in (os.environ.get("PIP_CERT"), ssl.get_default_verify_paths().cafile,
                      os.environ.get("SSL_CERT_FILE")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    import certifi  # pip's own fallback; requests brings it

    return Path(certifi.where())


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclasses.dataclass
class Made:
    """An image this script made or found: its tag, and what making it took (0 when cached)."""

    tag: str
    id: str
    cached: bool
    seconds: float


def say(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


# --- the Debian root filesystem ---------------------------------------------------------------


def ensure_rootfs(docker: Docker) -> Made:
    recipe = digest(json.dumps(DEBIAN, sort_keys=True), APT_DOCKER_CLEAN)
    tag = f"{ROOTFS_REPO}:{DEBIAN['suite']}-{recipe}"
    found = docker.image_id(tag)
    if found:
        return Made(tag, found, True, 0.0)
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap not found: apt-get install -y debootstrap")
    say(f"making {tag} with debootstrap (a few minutes)")
    started = time.monotonic()
    with scratch("podagent-rootfs-") as root:
        run(["debootstrap", f"--variant={DEBIAN['variant']}",
             f"--include={','.join(DEBIAN['include'])}", DEBIAN["suite"], str(root),
             DEBIAN["mirror"]], timeout=1800)
        # The downloaded .debs, apt's caches and package lists are not part of an image.
        for cache in ("var/cache/apt/archives", "var/cache/apt", "var/lib/apt/lists"):
            for item in (root / cache).glob("*"):
                if item.is_file():
                    item.unlink()
        (root / "etc/apt/apt.conf.d/docker-clean").write_text(APT_DOCKER_CLEAN)
        with subprocess.Popen(["tar", "--numeric-owner", "-C", str(root), "-c", "."],
                              stdout=subprocess.PIPE) as tar:
            run([docker.path, "import", "-", tag], stdin=tar.stdout.fileno(), timeout=900)
        if tar.returncode != 0:
            raise RuntimeError(f"tar of the root filesystem exited {tar.returncode}")
    made = Made(tag, docker.image_id(tag) or "", False, time.monotonic() - started)
    drop_other_tags(docker, ROOTFS_REPO, f"{DEBIAN['suite']}-", keep=tag)
    return made


# --- the bases -----------------------------------------------------------------------------------


def torch_wheel(into: Path) -> Path:
    """The CPU torch wheel, fetched the way this machine's pip finds it (never the CUDA one)."""
    into.mkdir(parents=True, exist_ok=True)
    proc = run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                "--dest", str(into), TORCH], check=False, timeout=1800)
    wheels = sorted(into.glob("torch-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"pip could not fetch {TORCH} (set PIP_EXTRA_INDEX_URL to PyTorch's CPU "
                           f"index where it is not on this machine):\n{proc.stderr[-2000:]}")
    return wheels[0]


def ensure_base(docker: Docker, base: Base, rootfs: Made) -> Made:
    with scratch("podagent-base-") as context:
        wheel = torch_wheel(context / "wheels")
        requirements = "\n".join([f"/tmp/context/wheels/{wheel.name}", *base.packages]) + "\n"
        (context / "requirements.txt").write_text(requirements)
        shutil.copyfile(host_ca_bundle(), context / "ca-bundle.pem")
        (context / "pip.conf").write_text("[global]\ncert = /etc/ssl/certs/pip-ca-bundle.pem\n")
        shutil.copyfile(BASE_DOCKERFILE, context / "Dockerfile")
        key = digest(rootfs.id, BASE_DOCKERFILE.read_bytes(), requirements, file_digest(wheel),
                     (context / "ca-bundle.pem").read_bytes(), (context / "pip.conf").read_bytes())
        tag = f"{BASE_REPO}:{base.name}-{key}"
        found = docker.image_id(tag)
        if found:
            return Made(tag, found, True, 0.0)
        say(f"building base {tag}: {base.description}")
        started = time.monotonic()
        run([docker.path, "build", "--network", "host", "--progress", "plain",
             "--build-arg", f"ROOTFS={rootfs.tag}", "--tag", tag, str(context)],
            env=docker.build_env, timeout=3600)
    made = Made(tag, docker.image_id(tag) or "", False, time.monotonic() - started)
    drop_other_tags(docker, BASE_REPO, f"{base.name}-", keep=tag)
    return made


def drop_other_tags(docker: Docker, repo: str, prefix: str, keep: str) -> None:
    """Remove this script's images that `keep` replaces (older hashes of the same thing), so the
    cache does not grow with every change of a recipe."""
    tags = docker("images", "--format", "{{.Repository}}:{{.Tag}}", repo).stdout.split()
    stale = [t for t in tags if t.startswith(f"{repo}:{prefix}") and t != keep]
    if stale:
        docker("rmi", *stale, check=False, timeout=600)


# --- podagent's image ----------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    base: Base
    base_image: Made
    image: Made
    base_size: int
    size: int

    @property
    def added(self) -> int:
        """Bytes podagent's layers add to the base."""
        return self.size - self.base_size


def build_image(docker: Docker, base: Base, base_image: Made, no_cache: bool = False) -> Built:
    """Build the repository's Dockerfile on the base. Docker's own cache makes an unchanged
    build take seconds; `no_cache` rebuilds every layer (what the build time means)."""
    tag = f"{IMAGE_REPO}:test-{base.name}"
    say(f"building {tag} on {base_image.tag}")
    started = time.monotonic()
    argv = [docker.path, "build", "--network", "host", "--progress", "plain",
            "--build-arg", f"BASE_IMAGE={base_image.tag}", "--label", IMAGE_LABEL,
            "--tag", tag, str(REPO)]
    if no_cache:
        argv.insert(2, "--no-cache")
    output = run(argv, env=docker.build_env, timeout=3600)
    seconds = time.monotonic() - started
    # The image this build replaced under the tag, and nothing else.
    docker("image", "prune", "--force", "--filter", f"label={IMAGE_LABEL}", check=False)
    # Steps that BuildKit took from its cache print CACHED; a build of nothing new is "cached".
    steps = re.findall(r"^#\d+ \[\d+/\d+\]", output.stderr, re.M)
    cached = bool(steps) and len(re.findall(r"^#\d+ CACHED$", output.stderr, re.M)) >= len(
        set(steps))
    image = Made(tag, docker.image_id(tag) or "", cached, seconds)
    return Built(base, base_image, image, docker.image_size(base_image.tag),
                 docker.image_size(tag))


def packages(docker: Docker, image: str) -> dict[str, str]:
    """name -> version of every distribution in the image's Python (pip's own listing)."""
    proc = docker("run", "--rm", "--network", "none", "--entrypoint", "python", image,
                  "-m", "pip", "list", "--format=json", timeout=300)
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(proc.stdout)}


def ensure_all(names: Sequence[str] = tuple(BASES), no_cache: bool = False,
               docker: Docker | None = None) -> tuple[Made, list[Built]]:
    docker = docker or find_docker()
    rootfs = ensure_rootfs(docker)
    built = []
    for name in names:
        base = BASES[name]
        built.append(build_image(docker, base, ensure_base(docker, base, rootfs), no_cache))
    return rootfs, built


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", action="append", choices=sorted(BASES),
                        help="build on this base only (repeatable; default: every base)")
    parser.add_argument("--no-cache", action="store_true",
                        help="rebuild podagent's image from scratch (the bases stay cached)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    rootfs, built = ensure_all(args.base or tuple(BASES), args.no_cache)
    rows = [{"base": b.base.name, "base_image": b.base_image.tag, "image": b.image.tag,
             "base_build_s": None if b.base_image.cached else round(b.base_image.seconds, 1),
             "image_build_s": round(b.image.seconds, 1), "image_cached": b.image.cached,
             "base_bytes": b.base_size, "image_bytes": b.size, "added_bytes": b.added}
            for b in built]
    if args.json:
        print(json.dumps({"rootfs": dataclasses.asdict(rootfs), "images": rows}, indent=2))
    else:
        for r in rows:
            print(f"{r['image']}: on {r['base_image']} ({mib(r['base_bytes'])}), podagent adds "
                  f"{mib(r['added_bytes'])}; build {r['image_build_s']} s"
                  f"{' (cached)' if r['image_cached'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
