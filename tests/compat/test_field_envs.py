"""podagent installs into the trainers' own environments and changes none of their packages.

Each field environment (fieldenv.FIELDS) is a fresh virtual environment holding the trainer's
pins; podagent (core + reward extra, from its wheel) is installed on top as a user would, and
every package that was there before must still be there at the same version.
"""

from __future__ import annotations

import re

import pytest

from tests.compat.fieldenv import FIELDS, ROOT, Installed, core_floors

EXIT_BAD_INPUT = 2


def installed(field_envs, name: str) -> Installed:
    return field_envs[name].result()


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_installing_podagent_changes_no_package_of_the_field(field_envs, name):
    field = installed(field_envs, name)
    assert field.changed() == {}, (
        f"pip changed {FIELDS[name].source} packages (before, after): {field.changed()}")
    assert "podagent" in field.after and "ray" in field.after


@pytest.mark.parametrize(("name", "pin"), [
    ("openrlhf", ("ray", "2.48.0")), ("openrlhf-m", ("math-verify", "0.5.2"))])
def test_the_fields_exact_pins_hold(field_envs, name, pin):
    package, version = pin
    assert installed(field_envs, name).after[package] == version


def test_verl_keeps_numpy_below_2(field_envs):
    numpy = installed(field_envs, "verl").after["numpy"]
    assert int(numpy.split(".")[0]) < 2, numpy


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_podagent_runs_there_and_names_that_ray(field_envs, name):
    field = installed(field_envs, name)
    shown = field.env.run([str(field.env.bin / "podagent"), "--version"])
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert shown.stdout.strip() == (
        f"podagent, version {field.after['podagent']} (Ray {field.after['ray']})")


def test_floor_holds_every_lower_bound(field_envs):
    """The core's lower bounds are installable together and podagent runs on them."""
    after = installed(field_envs, "floor").after
    for pin in core_floors():
        requirement, _, version = pin.partition("==")
        name = requirement.partition("[")[0]
        assert after[name].split(".")[:len(version.split("."))] == version.split("."), \
            (name, after[name])


# --- the core alone: the missing parts say what to install --------------------------------------


def _one_line_error(result) -> str:
    assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(("argv", "env", "words"), [
    (("head", "--dry-run"), {},
     ["PODAGENT_REWARD=builtin (the default)", "pip install 'podagent[reward]'",
      "PODAGENT_REWARD=none"]),
    (("reward-server",), {}, ["podagent reward-server", "pip install 'podagent[reward]'"]),
    (("head", "--dry-run"), {"PODAGENT_REWARD": "none"},
     ["the built-in cluster check", "needs torch", "PODAGENT_JOB"]),
    (("torchrun", "--", "train.py"), {}, ["podagent torchrun needs torch"]),
    (("check", "--cluster"), {}, ["the cluster check needs torch"]),
], ids=["default-reward", "reward-server", "cluster-check", "torchrun", "check-cluster"])
def test_core_alone_names_the_missing_part(field_envs, tmp_path, argv, env, words):
    field = installed(field_envs, "floor")
    result = field.env.run([str(field.env.bin / "podagent"), *argv],
                           env={"PODAGENT_LOG_DIR": str(tmp_path), **env}, timeout=120,
                           cwd=tmp_path)
    line = _one_line_error(result)
    for word in words:
        assert word in line, line


def test_core_alone_runs_a_head_plan_that_needs_no_extra(field_envs, tmp_path):
    field = installed(field_envs, "floor")
    result = field.env.run(
        [str(field.env.bin / "podagent"), "head", "--dry-run", "--", "python", "train.py"],
        env={"PODAGENT_REWARD": "none", "PODAGENT_LOG_DIR": str(tmp_path)}, timeout=120,
        cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"with Ray {field.after['ray']};" in result.stdout.splitlines()[0]


# --- the reward server on OpenRLHF-M's math-verify ---------------------------------------------

MATH_VERIFY_DECIDES = ("test_verify", "test_openrlhf_m", "test_openrlhf_m_server", "test_scorer")


def test_reward_tests_pass_on_openrlhf_ms_math_verify(field_envs, tmp_path):
    """Every reward test that math-verify decides (the verdict rules, the parity corpus, fast/slow
    agreement, the openrlhf-m server over the corpus) on math-verify 0.5.2, in the environment
    podagent[reward] went into beside OpenRLHF-M's pin. The server's protocol, CLI and head
    handling do not depend on math-verify's version and run in the main session only."""
    field = installed(field_envs, "openrlhf-m")
    env = field.env
    env.add("pytest>=8", "hypothesis>=6.100")
    assert env.packages()["math-verify"] == "0.5.2"
    modules = [f"tests/unit/rewards/{name}.py" for name in MATH_VERIFY_DECIDES]
    result = env.run([str(env.bin / "python"), "-m", "pytest", *modules, "-q",
                      "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "rewards")],
                     cwd=ROOT, timeout=1800)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = re.match(r"(\d+) passed(, \d+ warnings?)? in ", summary)
    assert passed and int(passed[1]) > 390, summary
