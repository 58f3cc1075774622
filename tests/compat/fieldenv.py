"""Fresh virtual environments holding the field's pins, with podagent installed on top.

The pins are the trainers' own, read from their public requirements files:
  OpenRLHF     ray[default]==2.48.0, grpcio>=1.74.0
  OpenRLHF-M   math-verify==0.5.2 (what its reward server runs)
  verl         numpy<2.0.0, ray[default] and math_verify unpinned
and `floor` holds every lower bound of podagent's own core dependencies.

Plain module (no pytest), so it can be driven by hand as well.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PIP_TIMEOUT = 900.0


@dataclass(frozen=True)
class Field:
    name: str
    pins: tuple[str, ...]  # what the trainer's image holds before podagent comes
    extras: str  # podagent's extras installed on top ("" for the core alone)
    source: str


FIELDS = {
    "openrlhf": Field("openrlhf", ("ray[default]==2.48.0", "grpcio>=1.74.0"), "reward",
                      "OpenRLHF requirements.txt"),
    "openrlhf-m": Field("openrlhf-m", ("math-verify==0.5.2",), "reward",
                        "OpenRLHF-M requirements.txt"),
    "verl": Field("verl", ("numpy<2.0.0", "ray[default]", "math_verify"), "reward",
                  "verl requirements.txt"),
    "floor": Field("floor", (), "", "podagent's own lower bounds"),
    # Not a trainer's: the first Ray whose `ray start --head` turns token auth on by itself
    # when it finds a token file (tests marked ray_auth run there).
    "ray-2.59": Field("ray-2.59", ("ray[default]==2.59.0",), "reward", "Ray 2.59"),
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_floors() -> tuple[str, ...]:
    """`name[extras]==lower bound` for each core dependency in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    core = text[text.index("dependencies = ["):text.index("[project.optional-dependencies]")]
    return tuple(f"{name}=={version}" for name, version in
                 re.findall(r'^\s*"([A-Za-z][\w-]*(?:\[[^\]]*\])?)>=([\d.]+)', core, re.M))


def from_test_extra(*names: str) -> tuple[str, ...]:
    """The requirements of pyproject.toml's test extra for these packages, as written there."""
    text = (ROOT / "pyproject.toml").read_text()
    extra = text[text.index("\ntest = ["):]
    extra = extra[:extra.index("\n]")]
    listed = {canonical(m[2]): m[1] for m in re.finditer(r'^\s*"(([A-Za-z][\w.-]*)[^"]*)"',
                                                        extra, re.M)}
    missing = [n for n in names if canonical(n) not in listed]
    assert not missing, f"the test extra has no {missing}"
    return tuple(listed[canonical(n)] for n in names)


class CommandFailed(AssertionError):
    pass


@dataclass
class FieldEnv:
    field: Field
    path: Path

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    def run(self, argv: list[str], env: dict[str, str] | None = None,
            timeout: float = PIP_TIMEOUT, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)

    def pip(self, *args: str) -> str:
        result = self.run([str(self.bin / "python"), "-m", "pip", "--disable-pip-version-check",
                           *args])
        if result.returncode:
            raise CommandFailed(f"{self.field.name}: pip {' '.join(args)} exited "
                                f"{result.returncode}:\n{(result.stdout + result.stderr)[-4000:]}")
        return result.stdout

    def packages(self) -> dict[str, str]:
        listed = json.loads(self.pip("list", "--format=json"))
        return {canonical(p["name"]): p["version"] for p in listed}

    def hold(self) -> Path:
        """A constraints file pinning every package now installed: later installs only add."""
        path = self.path / "held.txt"
        path.write_text("".join(f"{n}=={v}\n" for n, v in self.packages().items()))
        return path

    def add(self, *requirements: str) -> None:
        """What a test needs beside the field's packages, never changing one of them (held).
        With uv, whose cache the other environments share: torch, which two of them need, is
        unpacked once (pip: 42 CPU-s for each, uv: 31 s, then 1 s)."""
        argv = [_uv(), "pip", "install", "--quiet", "--python", str(self.bin / "python"),
                "--constraint", str(self.hold()), *requirements]
        result = self.run(argv)
        if result.returncode:
            raise CommandFailed(f"{self.field.name}: uv pip install {' '.join(requirements)} "
                                f"exited {result.returncode}:\n{result.stderr[-4000:]}")


@dataclass(frozen=True)
class Installed:
    env: FieldEnv
    before: dict[str, str]  # after the field's pins, before podagent
    after: dict[str, str]  # after podagent

    def changed(self) -> dict[str, tuple[str, str | None]]:
        return {n: (v, self.after.get(n)) for n, v in self.before.items()
                if self.after.get(n) != v}


def _uv() -> str:
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.exists() else "uv"


def create(field: Field, root: Path, wheel: Path) -> Installed:
    """A fresh venv with the field's pins, then podagent (with its extras) from `wheel`.

    The pins go in with uv (seconds, not minutes); podagent goes in with pip, as a user's
    `pip install` would put it into the trainer's image. Compiled, as pip leaves an image: Ray
    from source costs every process its compile (PYTHONDONTWRITEBYTECODE keeps none), and before
    2.52 `ray start` gives the dashboard's nine processes a fixed 20 s (16 s of it so spent on
    an idle two-core machine, all of it under load: a CI run's head failed five attempts).
    """
    path = root / field.name
    env = FieldEnv(field, path)
    for argv in ([_uv(), "venv", "--quiet", "--seed", "--python", sys.executable, str(path)],
                 [_uv(), "pip", "install", "--quiet", "--compile-bytecode", "--python",
                  str(env.bin / "python"), *(field.pins or core_floors())]):
        result = env.run(argv)
        if result.returncode:
            raise CommandFailed(f"{field.name}: {' '.join(argv[:3])} exited "
                                f"{result.returncode}:\n{result.stderr[-4000:]}")
    before = env.packages()
    target = f"podagent[{field.extras}]" if field.extras else "podagent"
    env.pip("install", f"{target} @ {wheel.as_uri()}")
    return Installed(env, before, env.packages())


def build_wheel(out: Path) -> Path:
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out),
                             str(ROOT)], capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise CommandFailed(f"building podagent's wheel: {result.stdout[-2000:]}"
                            f"{result.stderr[-2000:]}")
    (wheel,) = out.glob("podagent-*.whl")
    return wheel
