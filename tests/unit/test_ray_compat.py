"""The image's own Ray: found without importing it, named on the first line, its features gated.

Runs on every tested Ray (ray_matrix): the CLI cases assert what this image's Ray must give.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from podagent import config, errors, extras
from podagent.ray_access import ray_compat
from podagent.ray_access.ray_compat import RayVersion
from tests.unit.test_cli import assert_one_line_error, run_cli

pytestmark = pytest.mark.ray_matrix

TOKEN = "t0ken-for-tests-0123456789"


@pytest.mark.parametrize(("text", "release"), [
    ("2.48.0", (2, 48, 0)), ("2.60.1", (2, 60, 1)), ("3.0.0.dev0", (3, 0, 0)), ("2.9", (2, 9, 0)),
])
def test_parse(text, release):
    assert ray_compat.parse(text) == release


def test_parse_refuses_what_is_not_a_version():
    with pytest.raises(ValueError, match="not a Ray version"):
        ray_compat.parse("latest")


@pytest.mark.parametrize(("version", "tokens"), [
    ("2.48.0", False), ("2.51.2", False), ("2.52.0", True), ("2.60.0", True), ("3.1.0", True)])
def test_token_auth_from_2_52(version, tokens):
    assert RayVersion(version).has("token_auth") is tokens


@pytest.mark.parametrize(("version", "supported"), [
    ("2.47.1", False), ("2.48.0", True), ("2.55.1", True), ("2.60.0", True), ("2.60.7", True),
    ("2.61.0", False), ("3.0.0.dev0", False)])
def test_supported_range(version, supported):
    ray = RayVersion(version)
    assert ray.supported is supported
    note = ray_compat.untested_note(ray)
    if supported:
        assert note is None
    else:
        assert f"Ray {version} is " in note and "2.48.0 to 2.60.x" in note and "going on" in note
        assert ("newer" if ray.release > (2, 60) else "older") in note


@pytest.mark.parametrize("variable", ["PODAGENT_TOKEN", "RAY_AUTH_TOKEN"])
def test_a_token_on_a_ray_without_tokens_is_refused_naming_both(variable):
    settings = config.build({}, {variable: TOKEN})
    with pytest.raises(errors.RayFeatureMissing) as info:
        ray_compat.check(settings, RayVersion("2.48.0"))
    message = str(info.value)
    assert variable in message and "Ray 2.48.0" in message and "2.52.0" in message
    assert TOKEN not in message
    ray_compat.check(settings, RayVersion("2.52.0"))  # has them: nothing to refuse


def test_a_token_file_on_a_ray_without_tokens_names_the_path_variable(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    settings = config.build({}, {"RAY_AUTH_TOKEN_PATH": str(path)})
    with pytest.raises(errors.RayFeatureMissing, match="RAY_AUTH_TOKEN_PATH is set"):
        ray_compat.check(settings, RayVersion("2.51.2"))


def test_no_token_needs_nothing_of_ray():
    ray_compat.check(config.build({}, {}), RayVersion("2.48.0"))


@pytest.mark.parametrize(("head", "final"), [
    ("2.48.0", False), ("2.51.2", False), ("2.52.0", True), ("2.60.0", True), ("", False)])
def test_workers_wait_for_the_heads_node_where_its_start_may_be_retried(head, final):
    """Before 2.52 a head's `ray start` can fail after its GCS answered (the dashboard's fixed
    deadline) and be started again: there a worker waits for the head's node, not the GCS."""
    import io

    from podagent.platform.discovery import HeadFinder
    from podagent.report import Reporter
    from podagent.waiting import Signals

    finder = HeadFinder(config.build({}, {}), Reporter("worker", "t", None, stream=io.StringIO()),
                        Signals())
    finder.head_ray_version = head
    assert finder._head_start_is_final() is final


# --- the installed Ray ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_itself() -> str:
    """What `import ray` says in a fresh interpreter: the truth the metadata must match."""
    shown = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.strip()


def test_metadata_names_the_ray_that_imports(ray_itself):
    assert str(ray_compat.installed()) == f"Ray {ray_itself}"


def test_version_names_the_images_ray(tmp_path, ray_itself):
    run = run_cli(tmp_path, ("--version",), {})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith(f"(Ray {ray_itself})"), run.stdout


def test_first_line_names_the_ray_and_a_token_follows_its_features(tmp_path, ray_itself):
    """With a token: refused (exit 2, one line naming the variable and both versions) on a Ray
    without tokens; a plan naming the Ray on one that has them."""
    run = run_cli(tmp_path, ("head", "--dry-run"), {"PODAGENT_TOKEN": TOKEN})
    if RayVersion(ray_itself).has("token_auth"):
        assert run.returncode == 0, run.stderr
        first = run.stdout.splitlines()[0]
        assert f"with Ray {ray_itself};" in first, first
        assert "RAY_AUTH_MODE=token" in run.stdout
    else:
        line = assert_one_line_error(run, "PODAGENT_TOKEN is set", f"Ray {ray_itself}",
                                     "Ray 2.52.0 or newer")
        assert TOKEN not in line
    assert TOKEN not in run.stdout + run.stderr


def test_preflight_names_the_images_ray_and_what_it_cannot_do(tmp_path, ray_itself):
    """`podagent check`'s ray row: ok on a tested Ray; a token it cannot honour fails it."""
    import json

    run = run_cli(tmp_path, ("check", "--json"), {"PODAGENT_TOKEN": TOKEN})
    rows = {r["name"]: r for r in json.loads(run.stdout)["checks"]}
    ray = rows["ray"]
    if RayVersion(ray_itself).has("token_auth"):
        assert ray["status"] == "ok" and f"Ray {ray_itself} (tested: " in ray["detail"], ray
    else:
        assert run.returncode == 1, run.stdout
        assert ray["status"] == "fail", ray
        assert "PODAGENT_TOKEN is set" in ray["detail"] and f"Ray {ray_itself}" in ray["detail"]
        assert "Ray >= 2.52.0" in ray["fix"], ray
    assert TOKEN not in run.stdout + run.stderr


# --- extras --------------------------------------------------------------------------------------


def test_the_reward_extra_is_here():
    """Every environment the tests run in holds the reward extra (the matrix's too)."""
    assert extras.missing("reward") == ()


def test_a_missing_extra_names_what_to_install(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "demo", extras.Extra(
        "demo", ("json", "no_such_module_for_podagent"), "json and a missing one"))
    with pytest.raises(errors.MissingDependency) as info:
        extras.require("demo", "the demo", instead="turn it off")
    assert str(info.value) == (
        "the demo needs podagent's demo extra (json and a missing one; missing here: "
        "no_such_module_for_podagent): pip install 'podagent[demo]', or turn it off")
