"""config.build: flags > environment > defaults, one-line errors, derived values, the table."""

from __future__ import annotations

import dataclasses
import math
import re
import socket

import pytest

from podagent import config
from podagent.config.building import derived_run_name
from podagent.config.fields import (
    FIELD_BY_ATTR,
    FIELDS,
    FIRST_RUN,
    GROUP_BY_NAME,
    GROUPS,
    path_component,
    settings_page,
)
from podagent.config.names import OTHER_VARIABLES, known_variables, unknown_settings
from podagent.config.parsers import run_name
from podagent.errors import ConfigError

FIELD_BY_ENV = {f.env: f for f in FIELDS}


def build(env: dict[str, str] | None = None, flags: dict[str, str | None] | None = None,
          job_argv: tuple[str, ...] | None = None) -> config.Settings:
    return config.build(flags or {}, env or {}, job_argv)


# --- precedence ---------------------------------------------------------------------------------

# (attr, value given as a flag, value given in the environment, parsed flag value, parsed
#  environment value, default)
PRECEDENCE = [
    ("ray_port", "7000", "7001", 7000, 7001, 6379),
    ("dashboard_port", "9000", "9001", 9000, 9001, 8265),
    ("head_timeout", "5", "6.5", 5.0, 6.5, 600.0),
    ("worker_timeout", "30", "40", 30.0, 40.0, 600.0),
    ("dns_suffix", "a.example", "b.example", "a.example", "b.example", "runpod.internal"),
    ("nccl_preset", "none", "infiniband", "none", "infiniband", "auto"),
    ("expected_workers", "3", "4", 3, 4, 0),
    ("debug_ray", "1", "0", True, False, False),
    ("node_ip", "10.0.0.2", "10.0.0.3", "10.0.0.2", "10.0.0.3", None),
]


@pytest.mark.parametrize(("attr", "flag_raw", "env_raw", "flag_val", "env_val", "default"),
                         PRECEDENCE, ids=[p[0] for p in PRECEDENCE])
def test_flag_beats_environment_beats_default(attr, flag_raw, env_raw, flag_val, env_val,
                                              default):
    env_name = FIELD_BY_ATTR[attr].env

    both = build({env_name: env_raw}, {attr: flag_raw})
    assert getattr(both, attr) == flag_val
    assert both.sources[attr] == "flag"
    assert both.source_name(attr) == FIELD_BY_ATTR[attr].flag

    env_only = build({env_name: env_raw})
    assert getattr(env_only, attr) == env_val
    assert env_only.sources[attr] == "env"
    assert env_only.source_name(attr) == env_name

    neither = build()
    assert getattr(neither, attr) == default
    assert neither.sources[attr] == "default"


@pytest.mark.parametrize("blank", ["", " ", "\t", "  \n "])
@pytest.mark.parametrize(("attr", "default"), [
    ("ray_port", 6379), ("head_timeout", 600.0), ("nccl_preset", "auto"),
    ("head_pod_id", None), ("ray_worker", None), ("min_workers", None),
])
def test_empty_or_whitespace_environment_value_means_unset(attr, default, blank):
    s = build({FIELD_BY_ATTR[attr].env: blank})
    assert getattr(s, attr) == default
    assert s.sources[attr] == "default"


@pytest.mark.parametrize("blank", ["", "   "])
def test_empty_flag_falls_back_to_the_environment(blank):
    s = build({"PODAGENT_RAY_PORT": "7001"}, {"ray_port": blank})
    assert s.ray_port == 7001
    assert s.sources["ray_port"] == "env"


@pytest.mark.parametrize(("env", "attr", "expected"), [
    ({"PODAGENT_RAY_PORT": "  7001  "}, "ray_port", 7001),
    ({"HEAD_POD_ID": "\tabc123\n"}, "head_pod_id", "abc123"),
    ({"PODAGENT_RUN_NAME": " run-1 "}, "run_name", "run-1"),
    ({"PODAGENT_HEAD_TIMEOUT": " 2.5 "}, "head_timeout", 2.5),
    ({"PODAGENT_JOB": "  python  train.py  "}, "job", ("python", "train.py")),
])
def test_values_are_stripped(env, attr, expected):
    assert getattr(build(env), attr) == expected


def test_flag_values_are_stripped():
    assert build(flags={"ray_port": " 7002 "}).ray_port == 7002


def test_pod_ids_are_lowercased():
    s = build({"HEAD_POD_ID": "AbC123", "RUNPOD_POD_ID": "ABC123"})
    assert s.head_pod_id == s.pod_id == "abc123"
    assert s.head_dns_name == "abc123.runpod.internal"


# --- validation ---------------------------------------------------------------------------------

# (variable, bad value, a word of the rule the message must state)
INVALID = [
    ("EXPECTED_WORKERS", "two", "whole number"),
    ("EXPECTED_WORKERS", "-1", "whole number"),
    ("EXPECTED_WORKERS", "1.5", "whole number"),
    ("EXPECTED_WORKERS", "99999999", "whole number"),
    ("EXPECTED_WORKERS", "2000000", "<= 1000000"),
    ("PODAGENT_MIN_WORKERS", "some", "whole number"),
    ("NODE_RANK", "-1", "whole number"),
    ("NUM_NODES", "0", ">= 1"),
    ("PODAGENT_NUM_GPUS", "1025", "<= 1024"),
    ("PODAGENT_RAY_PORT", "0", "port"),
    ("PODAGENT_RAY_PORT", "65536", "port"),
    ("PODAGENT_RAY_PORT", "abc", "port"),
    ("PODAGENT_DASHBOARD_PORT", "-80", "port"),
    ("PODAGENT_WORKER_TIMEOUT", "0", "seconds"),
    ("PODAGENT_HEAD_TIMEOUT", "-3", "seconds"),
    ("PODAGENT_HEAD_GRACE", "nan", "seconds"),
    ("PODAGENT_STOP_TIMEOUT", "inf", "seconds"),
    ("PODAGENT_WORKER_TIMEOUT", "604801", "7 days"),
    ("PODAGENT_HEAD_TIMEOUT", "ten", "seconds"),
    ("RAY_WORKER", "yes", "0 or 1"),
    ("RAY_WORKER", "2", "0 or 1"),
    ("DEBUG_RAY", "true", "0 or 1"),
    ("HEAD_POD_ID", "abc def", "pod id"),
    ("HEAD_POD_ID", "HEAD_POD", "pod id"),
    ("HEAD_POD_ID", "a" * 64, "63 characters"),
    ("RUNPOD_POD_ID", "-abc", "pod id"),
    ("PODAGENT_DNS_SERVER", "host:port:x", "HOST:PORT"),
    ("PODAGENT_DNS_SERVER", ":53", "HOST:PORT"),
    ("PODAGENT_DNS_SERVER", "1.2.3.4:99999", "HOST:PORT"),
    ("PODAGENT_DNS_SERVER", "10.0.0.53:0", "HOST:PORT"),
    ("PODAGENT_NODE_IP", "10.0.0", "IPv4"),
    ("PODAGENT_NODE_IP", "256.1.1.1", "IPv4"),
    ("NODE_ADDR", "fe80::1", "IPv4"),
    ("PRIMARY_ADDR", "bad host!", "host name"),
    ("PODAGENT_HEAD_ADDR", "under_score.example", "host name"),
    ("PODAGENT_DNS_SUFFIX", "bad suffix", "DNS domain"),
    ("PODAGENT_NCCL_PRESET", "bogus", "one of auto"),
    ("PODAGENT_RUN_NAME", "a/b", "letters, digits"),
    ("PODAGENT_RUN_NAME", ".hidden", "letters, digits"),
    ("PODAGENT_RUN_NAME", "r" * 65, "1-64"),
    ("PODAGENT_JOB", "python -c 'print(1)", "command line"),
    ("PODAGENT_WORKING_DIR", "{missing}", "existing directory"),
    ("PODAGENT_RAY_TEMP_DIR", "t" * 61, "at most 60 bytes"),
    ("PODAGENT_LOG_DIR", "logs\x00dir", "path"),
    ("PODAGENT_AFTER_RUN", "halt", "one of stay, exit, stop-pod"),
    ("PODAGENT_AFTER_RUN", "Stay", "one of stay, exit, stop-pod"),
    ("PODAGENT_REJOIN", "yes", "0 or 1"),
    ("PODAGENT_ON_NODE_LOSS", "retry", "one of restart, wait, fail"),
    ("PODAGENT_RESTARTS", "-1", ""),
    ("PODAGENT_RETRY_FAILED_JOB", "true", "0 or 1"),
    ("RUNPOD_API_URL", "ftp://api.runpod.io", "http:// or https:// URL"),
    ("RUNPOD_API_URL", "api.runpod.io", "http:// or https:// URL"),
    ("RUNPOD_API_URL", "https://", "http:// or https:// URL"),
    ("RUNPOD_API_URL", "https://host:99999", "http:// or https:// URL"),
    ("RUNPOD_API_URL", "https://u:p@host", "http:// or https:// URL"),
    ("RUNPOD_API_URL", "https://host/x?x=1", "http:// or https:// URL"),
    ("RUNPOD_API_URL", "https://host/a b", "http:// or https:// URL"),
]


def _ids(cases):
    return [f"{var}={value[:12]!r}" for var, value, _ in cases]


def _value(raw: str, tmp_path) -> str:
    return str(tmp_path / "does-not-exist") if raw == "{missing}" else raw


def _check_message(exc: ConfigError, name: str, value: str, rule_word: str) -> None:
    message = str(exc)
    assert "\n" not in message and "\r" not in message
    assert message.startswith(f"{name}=")
    assert repr(value) in message
    assert rule_word in message
    assert "must" in message
    assert (exc.name, exc.value) == (name, value)


@pytest.mark.parametrize(("var", "raw", "rule_word"), INVALID, ids=_ids(INVALID))
def test_invalid_environment_value_raises_one_line_config_error(var, raw, rule_word, tmp_path):
    value = _value(raw, tmp_path)
    with pytest.raises(ConfigError) as info:
        build({var: value})
    _check_message(info.value, var, value, rule_word)


@pytest.mark.parametrize(("var", "raw", "rule_word"), INVALID, ids=_ids(INVALID))
def test_invalid_flag_value_names_the_flag(var, raw, rule_word, tmp_path):
    value = _value(raw, tmp_path)
    field = FIELD_BY_ENV[var]
    with pytest.raises(ConfigError) as info:
        # The environment holds a valid value: the flag is what is wrong, and what is named.
        build({}, {field.attr: value})
    _check_message(info.value, field.flag, value, rule_word)


def test_expected_workers_message_is_exact():
    with pytest.raises(ConfigError) as info:
        build({"EXPECTED_WORKERS": "two"})
    assert str(info.value) == "EXPECTED_WORKERS='two' must be a whole number >= 0"


def test_message_shows_the_stripped_value():
    with pytest.raises(ConfigError) as info:
        build({"EXPECTED_WORKERS": "  two\n"})
    assert str(info.value) == "EXPECTED_WORKERS='two' must be a whole number >= 0"


@pytest.mark.parametrize(("env", "attr", "expected"), [
    ({"PODAGENT_WORKER_TIMEOUT": "604800"}, "worker_timeout", 604800.0),
    ({"PODAGENT_HEAD_GRACE": "0.25"}, "head_grace", 0.25),
    ({"PODAGENT_RAY_PORT": "1"}, "ray_port", 1),
    ({"PODAGENT_RAY_PORT": "65535"}, "ray_port", 65535),
    ({"EXPECTED_WORKERS": "1000000"}, "expected_workers", 1_000_000),
    ({"PODAGENT_NUM_GPUS": "0"}, "num_gpus", 0),
    ({"HEAD_POD_ID": "a" * 63}, "head_pod_id", "a" * 63),
    ({"PODAGENT_RAY_TEMP_DIR": "t" * 60}, "ray_temp_dir", "t" * 60),
    ({"PODAGENT_DNS_SUFFIX": "Example.Internal."}, "dns_suffix", "example.internal"),
    ({"PRIMARY_ADDR": "head-node.example"}, "primary_addr", "head-node.example"),
])
def test_boundary_values_are_accepted(env, attr, expected):
    assert getattr(build(env), attr) == expected


def test_working_dir_is_resolved(tmp_path):
    assert build({"PODAGENT_WORKING_DIR": str(tmp_path)}).working_dir == str(tmp_path.resolve())


def test_seconds_never_yield_nan_or_inf():
    for raw in ("nan", "NaN", "inf", "-inf", "Infinity"):
        with pytest.raises(ConfigError):
            build({"PODAGENT_HEAD_TIMEOUT": raw})
    assert math.isfinite(build({"PODAGENT_HEAD_TIMEOUT": "1e3"}).head_timeout)


# --- derived values and relations ---------------------------------------------------------------

@pytest.mark.parametrize(("env", "expected"), [
    ({}, 0),
    ({"HEAD_POD_ID": "abc"}, 1),
    ({"NUM_NODES": "4"}, 3),
    ({"NUM_NODES": "1"}, 0),
    ({"HEAD_POD_ID": "abc", "EXPECTED_WORKERS": "5"}, 5),
    ({"NUM_NODES": "4", "EXPECTED_WORKERS": "0"}, 0),
    ({"HEAD_POD_ID": "abc", "EXPECTED_WORKERS": " "}, 1),
])
def test_expected_workers_default_is_derived(env, expected):
    s = build(env)
    assert s.expected_workers == expected
    assert s.sources["expected_workers"] == ("env" if env.get("EXPECTED_WORKERS", "").strip()
                                             else "default")


def test_expected_workers_flag_wins_over_derivation():
    assert build({"NUM_NODES": "4"}, {"expected_workers": "7"}).expected_workers == 7


@pytest.mark.parametrize(("env", "flags", "name", "words"), [
    ({"EXPECTED_WORKERS": "1", "PODAGENT_MIN_WORKERS": "2"}, {},
     "PODAGENT_MIN_WORKERS", ["EXPECTED_WORKERS (1)", "'2'"]),
    ({"PODAGENT_MIN_WORKERS": "1"}, {}, "PODAGENT_MIN_WORKERS", ["EXPECTED_WORKERS (0)"]),
    ({"NUM_NODES": "3"}, {"min_workers": "3"}, "--min-workers", ["EXPECTED_WORKERS (2)"]),
    ({"PODAGENT_RAY_PORT": "8265"}, {}, "PODAGENT_DASHBOARD_PORT",
     ["PODAGENT_RAY_PORT", "'8265'"]),
    ({"PODAGENT_DASHBOARD_PORT": "6379"}, {}, "PODAGENT_DASHBOARD_PORT", ["PODAGENT_RAY_PORT"]),
    ({}, {"dashboard_port": "6379"}, "--dashboard-port", ["PODAGENT_RAY_PORT"]),
    ({"PODAGENT_REWARD_PORT": "8265"}, {}, "PODAGENT_REWARD_PORT",
     ["PODAGENT_DASHBOARD_PORT", "'8265'"]),
    ({"PODAGENT_REWARD": "cmd"}, {}, "PODAGENT_REWARD_CMD", ["PODAGENT_REWARD=cmd"]),
    ({"PODAGENT_REWARD": "func"}, {}, "PODAGENT_REWARD_FUNC", ["PODAGENT_REWARD=func"]),
])
def test_relation_checks(env, flags, name, words):
    with pytest.raises(ConfigError) as info:
        build(env, flags)
    message = str(info.value)
    assert message.startswith(f"{name}=")
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(("text", "words"), [
    (None, "(no such file)"),
    ("def reward_func(q, p, l)\n", "(line 1: expected ':')"),
    ("def judge(q, p, l):\n    pass\n", "(it defines no reward_func at the top level)"),
])
def test_a_reward_func_file_is_checked_without_running_it(tmp_path, text, words):
    """The head's own check (exit 2 before anything starts); the file is read, never run."""
    path = tmp_path / "reward.py"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        build({"PODAGENT_REWARD": "func"}, {"reward_func": str(path)})
    assert str(info.value) == (f"--reward-func={str(path)!r} must be a Python file defining "
                               f"reward_func(queries, prompts, labels) {words}")


@pytest.mark.parametrize("text", [
    "def reward_func(queries, prompts, labels):\n    raise SystemExit(3)\n",
    "from judge import score as reward_func\n",
    "reward_func = lambda q, p, l: {'rewards': [0]}\n",
])
def test_a_reward_func_file_that_defines_it_is_accepted(tmp_path, text):
    path = tmp_path / "reward.py"
    path.write_text(text)
    assert build({"PODAGENT_REWARD": "func", "PODAGENT_REWARD_FUNC": str(path)}).reward_func \
        == str(path)


def test_relations_that_hold_are_accepted():
    s = build({"EXPECTED_WORKERS": "2", "PODAGENT_MIN_WORKERS": "2",
               "PODAGENT_RAY_PORT": "7000", "PODAGENT_DASHBOARD_PORT": "7001"})
    assert (s.min_workers, s.expected_workers, s.ray_port, s.dashboard_port) == (2, 2, 7000, 7001)


@pytest.mark.parametrize(("raw", "expected"), [
    ("10.0.0.53", ("10.0.0.53", 53)),
    ("10.0.0.53:5353", ("10.0.0.53", 5353)),
    ("dns.example:5300", ("dns.example", 5300)),
    ("DNS.Example", ("dns.example", 53)),
    ("::1", ("::1", 53)),
])
def test_dns_server_parsing(raw, expected):
    assert build({"PODAGENT_DNS_SERVER": raw}).dns_server == expected


def test_dns_server_unset_means_system_resolver():
    assert build().dns_server is None


def test_job_is_split_like_a_shell():
    s = build({"PODAGENT_JOB": "python -c 'print(1 + 1)' --flag"})
    assert s.job == ("python", "-c", "print(1 + 1)", "--flag")
    assert s.sources["job"] == "env"


def test_job_argv_overrides_podagent_job():
    s = build({"PODAGENT_JOB": "python env_job.py"}, job_argv=("python", "argv job.py", "-x"))
    assert s.job == ("python", "argv job.py", "-x")
    assert s.sources["job"] == "flag"


def test_empty_job_argv_keeps_podagent_job():
    assert build({"PODAGENT_JOB": "python a.py"}, job_argv=()).job == ("python", "a.py")


def test_run_name_default_uses_the_given_time():
    s = config.build({}, {}, None, now=86400 * 365 + 3661)
    assert s.run_name == "podagent-19710101-010101"
    assert re.fullmatch(r"podagent-\d{8}-\d{6}", build().run_name)


def test_run_dir_is_log_dir_slash_run_name_slash_this_pod(tmp_path):
    """One directory per pod under the run's: pods sharing a volume never collide."""
    s = build({"PODAGENT_LOG_DIR": str(tmp_path), "PODAGENT_RUN_NAME": "r1",
               "RUNPOD_POD_ID": "abc123xyz"})
    assert s.run_dir == tmp_path / "r1" / "abc123xyz" and s.pod_name == "abc123xyz"
    off_runpod = build({"PODAGENT_LOG_DIR": str(tmp_path), "PODAGENT_RUN_NAME": "r1"})
    assert off_runpod.run_dir == tmp_path / "r1" / path_component(socket.gethostname())


@pytest.mark.parametrize(("name", "component"), [
    ("abc123", "abc123"), ("host.example", "host.example"), ("..", "pod"), (".", "pod"),
    ("a/b", "a-b"), ("x" * 80, "x" * 63), (".hidden", "hidden"),
])
def test_a_pods_directory_name_is_one_safe_path_component(name, component):
    assert path_component(name) == component


# --- the Settings object ------------------------------------------------------------------------

def test_settings_is_frozen():
    s = build({"PODAGENT_RAY_PORT": "7000"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.ray_port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.environ["NEW"] = "x"  # type: ignore[index]
    with pytest.raises(TypeError):
        s.sources["ray_port"] = "flag"  # type: ignore[index]
    assert s.ray_port == 7000


def test_environ_is_a_snapshot():
    env = {"WANDB_PROJECT": "p1"}
    s = build(env)
    env["WANDB_PROJECT"] = "p2"
    env["LATER"] = "1"
    assert s.environ["WANDB_PROJECT"] == "p1"
    assert "LATER" not in s.environ


def test_instant_cluster_property():
    assert build({"NODE_RANK": "0"}).instant_cluster
    assert build({"PRIMARY_ADDR": "10.0.0.1"}).instant_cluster
    assert not build({"HEAD_POD_ID": "abc"}).instant_cluster


# --- the FIELDS table ---------------------------------------------------------------------------

def test_settings_page_has_one_row_per_field_in_its_groups_table():
    page = settings_page()
    tables = page.split("\n## ")
    assert len(tables) == len(GROUPS)
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(FIELDS)
    for row, f in zip(rows, FIELDS, strict=True):
        assert row.startswith(f"| `{f.flag}` | `{f.env}` |")
    for table, group in zip(tables, GROUPS, strict=True):
        assert table.removeprefix("## ").startswith(group.title)
        assert {f.flag for f in FIELDS if f.group == group.name} == \
            set(re.findall(r"^\| `(--[a-z-]+)`", table, re.M))


def test_every_setting_is_in_a_group_and_the_first_run_ones_exist():
    assert {f.group for f in FIELDS} == set(GROUP_BY_NAME)
    assert set(FIRST_RUN) <= set(FIELD_BY_ATTR)


def test_fields_flags_and_variables_are_well_formed_and_unique():
    for f in FIELDS:
        assert f.flag and f.flag.startswith("--"), f
        assert re.fullmatch(r"--[a-z][a-z0-9-]*", f.flag), f
        assert f.env == f.env.upper() and re.fullmatch(r"[A-Z][A-Z0-9_]*", f.env), f
        assert f.help.strip()
    for key in ("attr", "env", "flag"):
        values = [getattr(f, key) for f in FIELDS]
        assert len(values) == len(set(values)), key


def test_fields_defaults_match_settings_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(config.Settings)
                if f.default is not dataclasses.MISSING}
    for f in FIELDS:
        assert f.attr in {x.name for x in dataclasses.fields(config.Settings)}
        if f.default is not None:
            assert defaults[f.attr] == f.default, f.attr


# --- the cluster token: environment only, validated, never shown -----------------------------


def test_token_from_either_variable_and_its_headers():
    token = "t0ken-" + "a" * 20
    for name in ("RAY_AUTH_TOKEN", "PODAGENT_TOKEN"):
        s = build({name: token})
        assert s.auth_token == token
        assert s.auth_headers() == {"Authorization": f"Bearer {token}"}
        assert s.grpc_metadata() == (("authorization", f"Bearer {token}"),)
    assert build({}).auth_token is None and build({}).auth_headers() == {}


@pytest.mark.parametrize("bad", ["short", "has a space in it ok", "x" * 15, "tab\tinside-long-x"])
def test_bad_token_is_refused_without_showing_it(bad):
    with pytest.raises(ConfigError) as info:
        build({"PODAGENT_TOKEN": bad})
    message = str(info.value)
    assert message.startswith("PODAGENT_TOKEN=<redacted> must be at least 16")
    assert bad not in message


def test_two_different_tokens_are_refused():
    with pytest.raises(ConfigError) as info:
        build({"PODAGENT_TOKEN": "a" * 32, "RAY_AUTH_TOKEN": "b" * 32})
    assert "must equal RAY_AUTH_TOKEN" in str(info.value)
    assert "a" * 32 not in str(info.value) and "b" * 32 not in str(info.value)


def test_token_goes_to_ray_through_the_environment_never_argv():
    from podagent.cluster import ray_node
    from podagent.platform.roles import Role

    token = "c" * 40
    s = build({"PODAGENT_TOKEN": token})
    plan = ray_node.plan(s, Role.HEAD, "10.0.0.1", 0, {})
    assert plan.env_overrides["RAY_AUTH_MODE"] == "token"
    assert plan.env_overrides["RAY_AUTH_TOKEN"] == token
    assert not any(token in word for word in plan.argv)


def test_without_a_token_every_node_is_told_auth_is_off_where_ray_has_tokens():
    """Ray 2.59 on turns token auth on by itself when a token file is on the pod: podagent
    says `disabled` on every node instead of leaving it to Ray (ray_auth e2e: the cluster)."""
    from podagent.cluster import ray_node
    from podagent.platform.roles import Role
    from podagent.ray_access import ray_compat

    has_tokens = ray_compat.require().has("token_auth")
    for role in (Role.HEAD, Role.WORKER):
        plan = ray_node.plan(build({}), role, "10.0.0.1", 0, {}, head_ip="10.0.0.2")
        assert plan.env_overrides.get("RAY_AUTH_MODE") == ("disabled" if has_tokens else None)
        assert "RAY_AUTH_TOKEN" not in plan.env_overrides


def test_ray_auth_mode_token_without_a_cluster_token_is_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        build({"RAY_AUTH_MODE": "token"})
    assert str(info.value).startswith("RAY_AUTH_MODE='token' needs the run's cluster token on "
                                      "every pod: set PODAGENT_TOKEN, RAY_AUTH_TOKEN or "
                                      "RAY_AUTH_TOKEN_PATH")
    assert build({"RAY_AUTH_MODE": "token", "PODAGENT_TOKEN": "d" * 32}).auth_token


# --- RAY_AUTH_TOKEN_PATH: Ray's own token file --------------------------------------------------


def test_token_from_ray_auth_token_path(tmp_path):
    token = "f1le-" + "t" * 30
    path = tmp_path / "token"
    path.write_text(token + "\n")  # an editor's trailing newline is not part of the token
    s = build({"RAY_AUTH_TOKEN_PATH": str(path)})
    assert s.auth_token == token
    assert s.auth_headers() == {"Authorization": f"Bearer {token}"}
    path.write_text("changed-" + "x" * 30)
    assert s.auth_token == token  # read once, at build
    assert token not in repr(s)


def test_environment_token_and_the_same_file_token_agree(tmp_path):
    token = "s4me-" + "t" * 30
    path = tmp_path / "token"
    path.write_text(token)
    assert build({"RAY_AUTH_TOKEN_PATH": str(path), "PODAGENT_TOKEN": token}).auth_token == token


def test_a_file_token_that_differs_from_the_environment_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("a" * 32)
    with pytest.raises(ConfigError) as info:
        build({"RAY_AUTH_TOKEN_PATH": str(path), "PODAGENT_TOKEN": "b" * 32})
    message = str(info.value)
    assert message.startswith(f"RAY_AUTH_TOKEN_PATH='{path}' must name a file holding the same")
    assert "a" * 32 not in message and "b" * 32 not in message


def test_a_missing_token_file_names_the_variable_and_the_rule(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as info:
        build({"RAY_AUTH_TOKEN_PATH": str(missing)})
    assert str(info.value) == (f"RAY_AUTH_TOKEN_PATH='{missing}' must name a readable file "
                               f"that holds the cluster token (No such file or directory)")


@pytest.mark.parametrize("content", ["short", "has a space in it, so no", "", "\t" * 20,
                                     "x" * 15])
def test_a_bad_token_file_is_refused_without_showing_its_content(tmp_path, content):
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        build({"RAY_AUTH_TOKEN_PATH": str(path)})
    message = str(info.value)
    assert message.startswith(f"RAY_AUTH_TOKEN_PATH='{path}' must name a file that holds at "
                              f"least 16 printable characters")
    if content.strip():
        assert content not in message


def test_a_token_file_that_is_a_directory_or_not_text_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="must name a readable file"):
        build({"RAY_AUTH_TOKEN_PATH": str(tmp_path)})
    binary = tmp_path / "bin"
    binary.write_bytes(b"\xff\xfe" * 20)
    with pytest.raises(ConfigError, match=r"must name a readable file .* \(not text\)"):
        build({"RAY_AUTH_TOKEN_PATH": str(binary)})


def test_token_file_goes_to_ray_as_the_token(tmp_path):
    from podagent.cluster import ray_node
    from podagent.platform.roles import Role

    path = tmp_path / "token"
    path.write_text("d" * 40)
    plan = ray_node.plan(build({"RAY_AUTH_TOKEN_PATH": str(path)}), Role.HEAD, "10.0.0.1", 0, {})
    assert plan.env_overrides["RAY_AUTH_MODE"] == "token"
    assert plan.env_overrides["RAY_AUTH_TOKEN"] == "d" * 40
    assert not any("d" * 40 in word for word in plan.argv)


def test_listen_defaults_to_private():
    assert build().listen == "private"
    assert build({"PODAGENT_LISTEN": "all"}).listen == "all"


# --- the default run name: the same after a container restart ---------------------------------

@pytest.mark.parametrize(("env", "name", "source"), [
    ({"HEAD_POD_ID": "abc123"}, "podagent-abc123", "derived from HEAD_POD_ID"),
    ({"HEAD_POD_ID": "AbC123", "PRIMARY_ADDR": "10.65.0.2", "NUM_NODES": "2",
      "RUNPOD_POD_ID": "p1"}, "podagent-abc123", "derived from HEAD_POD_ID"),
    ({"PRIMARY_ADDR": "10.65.0.2", "NUM_NODES": "4", "RUNPOD_POD_ID": "p1"},
     "podagent-10-65-0-2-4n", "derived from PRIMARY_ADDR/NUM_NODES"),
    ({"PRIMARY_ADDR": "10.65.0.2"}, "podagent-10-65-0-2", "derived from PRIMARY_ADDR/NUM_NODES"),
    ({"PRIMARY_ADDR": "fd00::1", "NUM_NODES": "2"}, "podagent-fd00--1-2n",
     "derived from PRIMARY_ADDR/NUM_NODES"),
    ({"PRIMARY_ADDR": "Head-Node.example"}, "podagent-head-node-example",
     "derived from PRIMARY_ADDR/NUM_NODES"),
    ({"RUNPOD_POD_ID": "Pod1xyz", "NUM_NODES": "3"}, "podagent-pod1xyz",
     "derived from RUNPOD_POD_ID"),
])
def test_run_name_is_derived_from_what_survives_a_restart(env, name, source):
    first = config.build({}, env, None, now=0)
    again = config.build({}, env, None, now=86400 * 400)  # a restart, much later
    assert first.run_name == again.run_name == name
    assert first.sources["run_name"] == source
    assert run_name(name) == name


@pytest.mark.parametrize("env", [{}, {"NUM_NODES": "4"}, {"NODE_RANK": "0"},
                                 {"PODAGENT_HEAD_ADDR": "10.0.0.1"}])
def test_run_name_without_such_a_fact_is_the_start_time(env):
    s = config.build({}, env, None, now=86400 * 365 + 3661)
    assert s.run_name == "podagent-19710101-010101"
    assert s.sources["run_name"] == "default"
    assert not s.run_name_shared


@pytest.mark.parametrize(("env", "flags", "source"), [
    ({"PODAGENT_RUN_NAME": "mine", "HEAD_POD_ID": "abc"}, {}, "env"),
    ({"HEAD_POD_ID": "abc", "RUNPOD_POD_ID": "p1"}, {"run_name": "mine"}, "flag"),
])
def test_an_explicit_run_name_wins_over_derivation(env, flags, source):
    s = build(env, flags)
    assert (s.run_name, s.sources["run_name"]) == ("mine", source)
    assert s.run_name_shared


def test_flags_for_the_facts_derive_the_name_too():
    assert build(flags={"head_pod_id": "fromflag"}).run_name == "podagent-fromflag"


def test_a_long_head_pod_id_is_shortened_to_a_valid_distinct_name():
    one = build({"HEAD_POD_ID": "a" * 63})
    two = build({"HEAD_POD_ID": "a" * 62 + "b"})
    for s in (one, two):
        assert len(s.run_name) == 64
        assert re.fullmatch(r"podagent-a{46}-[0-9a-f]{8}", s.run_name), s.run_name
        assert run_name(s.run_name) == s.run_name
        assert s.sources["run_name"] == "derived from HEAD_POD_ID"
    assert one.run_name != two.run_name
    assert build({"HEAD_POD_ID": "a" * 55}).run_name == "podagent-" + "a" * 55  # 64: as is


def test_a_long_primary_addr_is_shortened_to_a_valid_name():
    addr = ".".join(["label" + "x" * 40] * 5)
    s = build({"PRIMARY_ADDR": addr, "NUM_NODES": "16"})
    assert len(s.run_name) <= 64 and run_name(s.run_name) == s.run_name
    assert s.run_name.startswith("podagent-label")


@pytest.mark.parametrize(("values", "expected"), [
    ({"head_pod_id": "odd id/with:chars_é"}, ("podagent-odd-id-with-chars",
                                               "derived from HEAD_POD_ID")),
    ({"head_pod_id": "x.y_z"}, ("podagent-x.y_z", "derived from HEAD_POD_ID")),
    ({"head_pod_id": "///", "pod_id": "p1"}, ("podagent-p1", "derived from RUNPOD_POD_ID")),
    ({"head_pod_id": "--..", "primary_addr": "::"}, None),
    ({}, None),
])
def test_derived_part_is_sanitized(values, expected):
    got = derived_run_name(values)
    if expected is None:
        assert got is None
        return
    assert got == expected
    assert run_name(got[0]) == got[0]


def test_derived_run_name_always_satisfies_the_rule():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None)
    @given(st.text(max_size=120), st.text(max_size=80), st.integers(1, 10**6) | st.none())
    def check(head, addr, nodes):
        got = derived_run_name({"head_pod_id": head, "primary_addr": addr,
                                "num_nodes": nodes})
        if got is not None:
            assert run_name(got[0]) == got[0]
            assert len(got[0]) <= 64

    check()


def test_run_name_shared_means_one_name_for_the_whole_cluster():
    assert build({"HEAD_POD_ID": "abc"}).run_name_shared
    assert build({"PRIMARY_ADDR": "10.0.0.1"}).run_name_shared
    assert not build({"RUNPOD_POD_ID": "p1"}).run_name_shared  # each pod has its own id


# --- after the run: stay, exit, stop-pod ------------------------------------------------------

KEY = "rpa_" + "S3cret" * 6


@pytest.mark.parametrize(("env", "expected", "source"), [
    ({}, "exit", "default"),
    ({"RUNPOD_POD_ID": "p1"}, "stay", "default"),  # no key to stop itself with: stays
    ({"RUNPOD_POD_ID": "p1", "RUNPOD_API_KEY": KEY}, "stop-pod", "default"),
    ({"RUNPOD_POD_ID": "p1", "PODAGENT_AFTER_RUN": "exit"}, "exit", "env"),
    ({"PODAGENT_AFTER_RUN": "stay"}, "stay", "env"),
    ({"RUNPOD_POD_ID": "p1", "RUNPOD_API_KEY": KEY, "PODAGENT_AFTER_RUN": "stop-pod"},
     "stop-pod", "env"),
])
def test_after_run(env, expected, source):
    s = build(env)
    assert (s.after_run, s.sources["after_run"]) == (expected, source)


@pytest.mark.parametrize(("env", "policy", "restarts"), [
    ({}, "restart", 3),
    ({"PODAGENT_RESTARTS": "0"}, "fail", 0),
    ({"PODAGENT_RESTARTS": "0", "PODAGENT_ON_NODE_LOSS": "restart"}, "restart", 0),
    ({"PODAGENT_ON_NODE_LOSS": "wait"}, "wait", 3),
])
def test_on_node_loss_restarts_unless_no_restarts_are_allowed(env, policy, restarts):
    s = build(env)
    assert (s.on_node_loss, s.restarts, s.retry_failed_job) == (policy, restarts, False)


def test_restart_backoff_may_be_zero_but_not_negative():
    assert build({"PODAGENT_RESTART_BACKOFF": "0"}).restart_backoff == 0.0
    with pytest.raises(ConfigError, match="seconds >= 0"):
        build({"PODAGENT_RESTART_BACKOFF": "-1"})


def test_stop_pod_needs_the_api_key():
    with pytest.raises(ConfigError) as info:
        build({"RUNPOD_POD_ID": "p1", "PODAGENT_AFTER_RUN": "stop-pod"})
    assert str(info.value) == ("RUNPOD_API_KEY='' must be set when PODAGENT_AFTER_RUN=stop-pod "
                               "(podagent stops this pod through RunPod's API)")


def test_stop_pod_by_flag_names_the_flag():
    with pytest.raises(ConfigError) as info:
        build({"RUNPOD_POD_ID": "p1", "RUNPOD_API_KEY": "  "}, {"after_run": "stop-pod"})
    assert str(info.value).startswith("RUNPOD_API_KEY='' must be set when --after-run=stop-pod")


def test_stop_pod_needs_the_pod_id():
    with pytest.raises(ConfigError) as info:
        build({"RUNPOD_API_KEY": KEY, "PODAGENT_AFTER_RUN": "stop-pod"})
    message = str(info.value)
    assert message == ("RUNPOD_POD_ID='' must be set when PODAGENT_AFTER_RUN=stop-pod (the id "
                       "of the pod to stop; RunPod sets it)")
    assert KEY not in message


def test_the_api_key_is_read_from_the_environment_and_never_shown():
    s = build({"RUNPOD_POD_ID": "p1", "RUNPOD_API_KEY": f" {KEY}\n",
               "PODAGENT_AFTER_RUN": "stop-pod", "PODAGENT_TOKEN": "t" * 32})
    assert s.runpod_api_key == KEY
    assert KEY not in repr(s) and "t" * 32 not in repr(s)
    assert build().runpod_api_key is None
    assert "runpod_api_key" not in FIELD_BY_ATTR  # never a flag


def test_rejoin_and_api_url():
    s = build()
    assert s.rejoin is True and s.sources["rejoin"] == "default"
    assert s.runpod_api_url == "https://api.runpod.io"  # v2's server: one setting, pod and up
    assert build({"PODAGENT_REJOIN": "0"}).rejoin is False
    assert build(flags={"rejoin": "0"}).rejoin is False
    assert build({"RUNPOD_API_URL": "http://10.0.0.9:8080/"}).runpod_api_url == (
        "http://10.0.0.9:8080")
    assert build({"RUNPOD_API_URL": "http://[fd00::9]:80"}).runpod_api_url == (
        "http://[fd00::9]:80")
    # v1's old setting is retired: said once, ignored (its v1 address would no longer work).
    old = build({"PODAGENT_RUNPOD_API_URL": "https://rest.runpod.io/v1"})
    assert old.runpod_api_url == "https://api.runpod.io"
    assert any(w.startswith("PODAGENT_RUNPOD_API_URL is retired") for w in old.warnings)


# --- PODAGENT_* variables podagent does not know ----------------------------------------------

def test_a_typo_gets_the_closest_name():
    assert unknown_settings({"PODAGENT_WORKER_TIMOUT": "30"}) == [
        "PODAGENT_WORKER_TIMOUT is not a podagent setting; did you mean "
        "PODAGENT_WORKER_TIMEOUT? (ignored)"]


@pytest.mark.parametrize(("name", "suggestion"), [
    ("PODAGENT_EXPECTED_WORKERS", "EXPECTED_WORKERS"),  # RunPod's name has no prefix
    ("PODAGENT_HEAD_POD", "HEAD_POD_ID"),
    ("PODAGENT_REWARD_WORKER", "PODAGENT_REWARD_WORKERS"),  # the reward server's table
    ("PODAGENT_AFTERRUN", "PODAGENT_AFTER_RUN"),
    ("PODAGENT_NUM_NODE", "NUM_NODES"),  # the setting, not the name podagent sets for the job
])
def test_suggestions(name, suggestion):
    [line] = unknown_settings({name: "1"})
    assert line == f"{name} is not a podagent setting; did you mean {suggestion}? (ignored)"


def test_no_close_name_means_no_suggestion():
    assert unknown_settings({"PODAGENT_BANANAS": "1"}) == [
        "PODAGENT_BANANAS is not a podagent setting (ignored)"]


def test_a_warning_never_shows_the_value():
    secret = "hunter2-" + "z" * 30
    lines = unknown_settings({"PODAGENT_TOKN": secret, "PODAGENT_API_KEY": secret})
    assert len(lines) == 2
    assert not any(secret in line for line in lines)
    assert "PODAGENT_TOKN is not a podagent setting; did you mean PODAGENT_TOKEN?" in lines[1]


def test_known_names_other_variables_and_empty_values_are_not_warned_about():
    env = {f.env: "x" for f in FIELDS}
    env.update({name: "x" for name in OTHER_VARIABLES})
    env.update({"PODAGENT_REWARD_WORKERS": "3", "PODAGENT_REWARD_HOST": "0.0.0.0",
                "PODAGENT_TOKEN": "t" * 32, "PODAGENT_NUM_NODES": "2", "PODAGENT_NUM_GPUS": "8",
                "PODAGENT_HEAD_ADDR": "10.0.0.1", "PODAGENT_RAY_MATRIX_ONLY": "1",
                "RAY_WORKER_TIMOUT": "1", "podagent_lower": "1", "PODAGENTX": "1",
                "PODAGENT_PLACEHOLDER": "", "PODAGENT_BLANK": "  "})
    assert unknown_settings(env) == []


def test_an_odd_name_is_shown_escaped():
    [line] = unknown_settings({"PODAGENT_X\nY": "1"})
    assert "\n" not in line and line.startswith("'PODAGENT_X\\nY' is not a podagent setting")


def test_build_carries_the_warnings_and_ignores_the_typo():
    s = build({"PODAGENT_WORKER_TIMOUT": "30", "PODAGENT_HEAD_TIMEOUT": "40"})
    assert s.warnings == ("PODAGENT_WORKER_TIMOUT is not a podagent setting; did you mean "
                          "PODAGENT_WORKER_TIMEOUT? (ignored)",)
    assert s.worker_timeout == 600.0 and s.head_timeout == 40.0
    assert build().warnings == ()


def test_every_podagent_variable_the_code_uses_is_known():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [root / "Dockerfile", root / "tests" / "conftest.py"]
    for folder in ("podagent", "entrypoints", "docker", "bench", "tests/harness",
                   "tests/compat"):
        files += [p for p in (root / folder).rglob("*") if p.is_file()
                  and p.suffix in (".py", ".sh", ".json", ".Dockerfile", ".env", "")]
    used = set()
    for path in files:
        if path.exists():
            used |= set(re.findall(r"\bPODAGENT_[A-Z0-9_]*[A-Z0-9]\b",
                                   path.read_text(errors="replace")))
    used -= {"PODAGENT_VERSION"}  # a Python name (podagent.__version__), not a variable
    assert used, "the scan found nothing: the layout changed"
    assert used <= known_variables(), sorted(used - known_variables())
