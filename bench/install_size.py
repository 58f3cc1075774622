"""What installing podagent adds to an image, in MB: the core, the extras, and podagent as it was.

Two stand-ins for users' images, each a fresh virtual environment: torch alone (a CUDA/PyTorch
base), and torch with OpenRLHF's `ray[default]==2.48.0` (a trainer's image). Into copies of
each go podagent's core, core + [reward], and core + [reward,wandb] (what the Docker image
installs), from the wheel of this checkout; the baseline is podagent as it was before its core
was split (a wheel of --baseline-rev), installed the same way. A size is what `site-packages`
grew by.

    python bench/install_size.py [--torch torch==2.13.0] [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASES = (("torch", ()), ("torch + ray[default]==2.48.0", ("ray[default]==2.48.0",)))
TARGETS = (("core", ""), ("core + reward", "[reward]"), ("core + reward + wandb", "[reward,wandb]"))
MB = 1024 * 1024


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def site_packages(venv: Path) -> Path:
    (found,) = (venv / "lib").glob("python*/site-packages")
    return found


def pip(venv: Path, *args: str) -> float:
    started = time.monotonic()
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", *args], check=True, timeout=1800)
    return time.monotonic() - started


def wheel(source: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w",
                    str(out), str(source)], check=True, timeout=600)
    (found,) = out.glob("podagent-*.whl")
    return found


def baseline_wheel(rev: str, work: Path) -> Path:
    """podagent at an earlier commit, built from `git archive` of it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True, timeout=120).stdout
    source = work / "baseline-src"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    return wheel(source, work / "baseline-dist")


def fresh(path: Path, torch: str, pins: tuple[str, ...]) -> tuple[int, int]:
    """(size of an empty venv, size once the image's packages are in)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    empty = du(site_packages(path))
    pip(path, torch, *pins)
    return empty, du(site_packages(path))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="torch==2.13.0",
                        help="the torch requirement the image already has")
    parser.add_argument("--baseline-rev", default="4f25bf9",
                        help="git revision of podagent before its core was split")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="podagent-size-"))
    rows = []
    try:
        ours = wheel(ROOT, work / "dist")
        before = baseline_wheel(args.baseline_rev, work)
        for base_label, pins in BASES:
            base = work / f"base-{len(pins)}"
            empty, image = fresh(base, args.torch, pins)
            rows.append((base_label, "(the image itself)", image - empty, None))
            installs = [(label, f"podagent{extra} @ {ours.as_uri()}")
                        for label, extra in TARGETS]
            installs.append((f"baseline ({args.baseline_rev}: one install)",
                             f"podagent @ {before.as_uri()}"))
            for label, requirement in installs:
                venv = work / f"{base.name}-{len(rows)}"
                shutil.copytree(base, venv, symlinks=True)
                took = pip(venv, requirement)
                rows.append((base_label, label, du(site_packages(venv)) - image, took))
                shutil.rmtree(venv)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"install size (Python {sys.version.split()[0]}, {os.uname().machine}, "
          f"{args.torch})")
    print("| image | podagent | adds | vs baseline | install time |")
    print("|---|---|---|---|---|")
    baselines = {base: size for base, label, size, _ in rows if label.startswith("baseline")}
    for base, label, size, took in rows:
        ratio = "-" if took is None else f"{size / baselines[base]:.2f}"
        when = "-" if took is None else f"{took:.0f} s"
        print(f"| {base} | {label} | {size / MB:.0f} MB | {ratio} | {when} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
