"""The image, built for real from the repository's Dockerfile on bases that stand in for
trainers' images (docker/images.py): the build only adds, and what it made is what the
Dockerfile says."""

from __future__ import annotations

import json

import pytest

from tests.container.engine import images
from tests.unit.test_container import dockerfile_env, dockerfile_instructions, image_argv, only

BASES = sorted(images.BASES)


@pytest.mark.parametrize("base", BASES)
def test_build_keeps_every_package_of_the_base(engine, built, base):
    """Ray, torch and math-verify above all: every package the base has is still there at its
    version, podagent's are added, and podagent runs with the base's Ray."""
    b = built[base]
    before = images.packages(engine.docker, b.base_image.tag)
    after = images.packages(engine.docker, b.image.tag)
    assert {"ray", "torch"} <= set(before), sorted(before)
    changed = {name: (version, after.get(name)) for name, version in before.items()
               if after.get(name) != version}
    assert not changed, f"the build changed the base's packages (base, image): {changed}"
    for name in images.KEPT:
        if name in before:
            assert after[name] == before[name], name
    assert {"podagent", "wandb", "pebble"} <= set(after) - set(before)
    # The base's own pins, as the bases declare them.
    pins = dict(p.split("==") for p in images.BASES[base].packages)
    assert after["ray"] == pins["ray[default]"]
    assert after["torch"].startswith("2.13.0")
    if "math-verify" in pins:
        assert after["math-verify"] == pins["math-verify"]
    else:
        assert "math-verify" in after  # the reward extra brought it
    print(f"\n{b.image.tag}: podagent adds {images.mib(b.added)} to {images.mib(b.base_size)}")

    ran = engine.docker("run", "--rm", "--network", "none", "--entrypoint", "python", b.image.tag,
                        "-c", "import ray, podagent; print(ray.__version__, podagent.__version__)")
    assert ran.stdout.split() == [pins["ray[default]"], after["podagent"]], ran.stdout


def test_image_runs_what_the_dockerfile_says(engine, built):
    """ENTRYPOINT (tini, then the script), HEALTHCHECK and ENV of the built image are the
    Dockerfile's, and tini is where the ENTRYPOINT expects it."""
    instructions = dockerfile_instructions()
    for b in built.values():
        config = engine.docker("image", "inspect", "--format", "{{json .Config}}", b.image.tag)
        cfg = json.loads(config.stdout)
        assert cfg["Entrypoint"] + (cfg["Cmd"] or []) == image_argv(instructions)
        health = only(instructions, "HEALTHCHECK").args.partition(" CMD ")[2]
        assert cfg["Healthcheck"]["Test"] == ["CMD", *json.loads(health)]
        env = dict(line.split("=", 1) for line in cfg["Env"])
        for key, value in dockerfile_env(instructions).items():
            assert env[key] == value, key
        tini = engine.docker("run", "--rm", "--network", "none", "--entrypoint",
                             cfg["Entrypoint"][0], b.image.tag, "--version")
        assert "tini version" in tini.stdout + tini.stderr
