"""roles.detect_role: the documented rule order, every contradiction, the head location."""

from __future__ import annotations

import pytest

from podagent import config
from podagent.errors import ConfigError, RoleConflict
from podagent.platform.roles import Role, detect_role

HEAD, WORKER = Role.HEAD, Role.WORKER


def settings(**env: str) -> config.Settings:
    return config.build({}, env)


# (environment, explicit subcommand, role, words the reason must contain)
RULES = [
    # 1. an explicit subcommand
    ({}, HEAD, HEAD, ["`podagent head`"]),
    ({"HEAD_POD_ID": "h1"}, WORKER, WORKER, ["`podagent worker`"]),
    ({"RAY_WORKER": "1", "HEAD_POD_ID": "h1"}, WORKER, WORKER, ["`podagent worker`"]),
    ({"NODE_RANK": "0", "PRIMARY_ADDR": "10.0.0.1"}, HEAD, HEAD, ["`podagent head`"]),
    # 2. RAY_WORKER
    ({"RAY_WORKER": "1", "HEAD_POD_ID": "h1"}, None, WORKER, ["RAY_WORKER=1"]),
    ({"RAY_WORKER": "0"}, None, HEAD, ["RAY_WORKER=0"]),
    ({"RAY_WORKER": "1", "PODAGENT_HEAD_ADDR": "10.0.0.9"}, None, WORKER, ["RAY_WORKER=1"]),
    # RAY_WORKER is rule 2: it decides even where rule 3 or 4 agree.
    ({"RAY_WORKER": "1", "HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "w1"}, None, WORKER,
     ["RAY_WORKER=1"]),
    ({"RAY_WORKER": "0", "NODE_RANK": "0"}, None, HEAD, ["RAY_WORKER=0"]),
    # 3. HEAD_POD_ID compared with RUNPOD_POD_ID
    ({"HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "h1"}, None, HEAD,
     ["RUNPOD_POD_ID=h1", "HEAD_POD_ID"]),
    ({"HEAD_POD_ID": "H1", "RUNPOD_POD_ID": "h1"}, None, HEAD, ["HEAD_POD_ID"]),
    ({"HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "w1"}, None, WORKER,
     ["RUNPOD_POD_ID=w1", "HEAD_POD_ID=h1"]),
    # rule 3 before rule 4
    ({"HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "h1", "NODE_RANK": "0"}, None, HEAD,
     ["RUNPOD_POD_ID"]),
    # 4. Instant Cluster
    ({"NODE_RANK": "0", "PRIMARY_ADDR": "10.0.0.1"}, None, HEAD, ["NODE_RANK=0"]),
    ({"NODE_RANK": "2", "PRIMARY_ADDR": "10.0.0.1"}, None, WORKER, ["NODE_RANK=2"]),
    ({"PRIMARY_ADDR": "10.0.0.1"}, None, WORKER, ["PRIMARY_ADDR=10.0.0.1"]),
    ({"PRIMARY_ADDR": "head.example"}, None, WORKER, ["PRIMARY_ADDR=head.example"]),
    # 5. nothing
    ({}, None, HEAD, ["no role variable", "a standalone head"]),
    ({"EXPECTED_WORKERS": "2"}, None, HEAD,
     ["no role variable", "the head of 2 expected worker(s)"]),
]


@pytest.mark.parametrize(("env", "explicit", "role", "words"), RULES)
def test_rules(env, explicit, role, words):
    decision = detect_role(settings(**env), explicit)
    assert decision.role is role
    for word in words:
        assert word in decision.reason


# (environment, explicit subcommand, the two facts the message must name)
CONFLICTS = [
    ({"RAY_WORKER": "0", "HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "w1"}, None,
     "RAY_WORKER=0", "RUNPOD_POD_ID=w1 differs from HEAD_POD_ID=h1"),
    ({"RAY_WORKER": "1", "HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "h1"}, None,
     "RAY_WORKER=1", "RUNPOD_POD_ID=h1 equals HEAD_POD_ID"),
    ({"RAY_WORKER": "1", "NODE_RANK": "0", "PRIMARY_ADDR": "10.0.0.1"}, None,
     "RAY_WORKER=1", "NODE_RANK=0"),
    ({"RAY_WORKER": "0", "NODE_RANK": "3", "PRIMARY_ADDR": "10.0.0.1"}, None,
     "RAY_WORKER=0", "NODE_RANK=3"),
    ({"HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "h1", "NODE_RANK": "1"}, None,
     "RUNPOD_POD_ID=h1 equals HEAD_POD_ID", "NODE_RANK=1"),
    ({"HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "w1", "NODE_RANK": "0"}, None,
     "RUNPOD_POD_ID=w1 differs from HEAD_POD_ID=h1", "NODE_RANK=0"),
    ({"RAY_WORKER": "1", "HEAD_POD_ID": "h1"}, HEAD, "`podagent head`", "RAY_WORKER=1"),
    ({"RAY_WORKER": "0"}, WORKER, "`podagent worker`", "RAY_WORKER=0"),
    ({"HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "w1"}, HEAD,
     "`podagent head`", "RUNPOD_POD_ID=w1 differs from HEAD_POD_ID=h1"),
    ({"HEAD_POD_ID": "h1", "RUNPOD_POD_ID": "h1"}, WORKER,
     "`podagent worker`", "RUNPOD_POD_ID=h1 equals HEAD_POD_ID"),
    ({"NODE_RANK": "0", "PRIMARY_ADDR": "10.0.0.1"}, WORKER, "`podagent worker`", "NODE_RANK=0"),
    ({"NODE_RANK": "1", "PRIMARY_ADDR": "10.0.0.1"}, HEAD, "`podagent head`", "NODE_RANK=1"),
]


@pytest.mark.parametrize(("env", "explicit", "first", "second"), CONFLICTS)
def test_contradictions_are_refused_naming_both_facts(env, explicit, first, second):
    with pytest.raises(RoleConflict) as info:
        detect_role(settings(**env), explicit)
    message = str(info.value)
    assert first in message
    assert second in message
    assert "head" in message and "worker" in message
    assert "\n" not in message


@pytest.mark.parametrize(("env", "explicit"), [
    ({"RAY_WORKER": "1"}, None),
    ({}, WORKER),
    ({"NODE_RANK": "1"}, None),
    ({"RAY_WORKER": "1", "RUNPOD_POD_ID": "w1"}, None),
])
def test_worker_without_a_head_location_is_a_config_error(env, explicit):
    with pytest.raises(ConfigError) as info:
        detect_role(settings(**env), explicit)
    assert info.value.name == "HEAD_POD_ID"
    assert str(info.value).startswith("HEAD_POD_ID=")
    assert "worker" in str(info.value)


@pytest.mark.parametrize("env", [
    {"RAY_WORKER": "1", "HEAD_POD_ID": "h1"},
    {"RAY_WORKER": "1", "PODAGENT_HEAD_ADDR": "10.0.0.9"},
    {"RAY_WORKER": "1", "PRIMARY_ADDR": "10.0.0.1"},
])
def test_any_one_head_location_is_enough_for_a_worker(env):
    assert detect_role(settings(**env)).role is WORKER


def test_head_needs_no_head_location():
    assert detect_role(settings(RAY_WORKER="0")).role is HEAD
