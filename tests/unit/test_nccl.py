"""NCCL presets: files, choice by evidence, merge under the user's environment, interfaces."""

from __future__ import annotations

import pytest

from podagent import config
from podagent.platform import nccl

RUNPOD_GLOBAL = {
    "NCCL_NET_SOCKET_FAMILY": "IPv4",
    "NCCL_LAUNCH_MODE": "GROUP",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "podnet1",
    "NCCL_SOCKET_NTHREADS": "1",
    "NCCL_NSOCKS_PERTHREAD": "1",
    "FORCE_MODEL_INIT_TO_CUDA": "1",
}

POD_IFACES = {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"], "podnet1": ["10.0.0.5"]}
PLAIN_IFACES = {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"]}


def settings(**env: str) -> config.Settings:
    return config.build({}, env)


# --- preset files -------------------------------------------------------------------------------

def test_the_four_presets_exist():
    assert {"runpod-global", "runpod-cluster", "infiniband", "none"} <= set(nccl.preset_names())
    assert list(nccl.preset_names()) == sorted(nccl.preset_names())


def test_runpod_global_has_the_seven_seed_variables():
    preset = nccl.load_presets()["runpod-global"]
    assert dict(preset.variables) == RUNPOD_GLOBAL
    assert preset.description.startswith("RunPod Global Networking")


def test_runpod_cluster_uses_ens1():
    preset = nccl.load_presets()["runpod-cluster"]
    assert preset.variables["NCCL_SOCKET_IFNAME"] == "ens1"
    assert preset.variables["NCCL_NET_SOCKET_FAMILY"] == "IPv4"


def test_infiniband_uses_the_first_hca_and_ib0():
    variables = nccl.load_presets()["infiniband"].variables
    assert variables["NCCL_IB_HCA"] == "mlx5_0"
    assert variables["NCCL_SOCKET_IFNAME"] == "ib0"
    assert variables["NCCL_IB_DISABLE"] == "0"


def test_none_is_empty():
    preset = nccl.load_presets()["none"]
    assert dict(preset.variables) == {}
    assert preset.description


def test_presets_are_read_only():
    with pytest.raises(TypeError):
        nccl.load_presets()["none"].variables["X"] = "1"  # type: ignore[index]


# --- parse_env_file -----------------------------------------------------------------------------

def test_parse_env_file():
    text = (
        "# First line of the description.\n"
        "#   Second line.\n"
        "\n"
        "A=1\n"
        "  B = two words  \n"
        "# a comment after the variables is not description\n"
        "C=x=y\n"
        "EMPTY=\n"
    )
    description, variables = nccl.parse_env_file(text)
    assert description == "First line of the description. Second line."
    assert variables == {"A": "1", "B": "two words", "C": "x=y", "EMPTY": ""}


@pytest.mark.parametrize(("text", "line"), [
    ("A=1\nNOEQUALS\n", 2),
    ("1A=x\n", 1),
    ("# description\n=x\n", 2),
    ("export A=1\n", 1),
    ("A B=1\n", 1),
    ("A-B=1\n", 1),
])
def test_parse_env_file_errors_name_origin_and_line(text, line):
    with pytest.raises(ValueError) as info:
        nccl.parse_env_file(text, origin="bad.env")
    message = str(info.value)
    assert message.startswith(f"bad.env:{line}: expected KEY=VALUE")
    assert repr(text.splitlines()[line - 1]) in message


# --- choose -------------------------------------------------------------------------------------

# (environment, flags, interfaces, InfiniBand devices, preset, words of the reason)
CHOICES = [
    ({"PODAGENT_NCCL_PRESET": "none"}, {}, POD_IFACES, ["mlx5_0"], "none",
     ["PODAGENT_NCCL_PRESET"]),
    ({"PODAGENT_NCCL_PRESET": "none"}, {"nccl_preset": "infiniband"}, PLAIN_IFACES, [],
     "infiniband", ["--nccl-preset"]),
    ({"PODAGENT_NCCL_PRESET": "runpod-global", "NODE_RANK": "0"}, {}, PLAIN_IFACES, [],
     "runpod-global", ["PODAGENT_NCCL_PRESET"]),
    ({"NODE_RANK": "1", "PRIMARY_ADDR": "10.0.0.1"}, {}, {**POD_IFACES, "ib0": []}, ["mlx5_0"],
     "runpod-cluster", ["Instant Cluster"]),
    ({"NUM_NODES": "2"}, {}, PLAIN_IFACES, [], "runpod-cluster", ["Instant Cluster"]),
    ({}, {}, {**PLAIN_IFACES, "ib0": ["192.168.50.2"]}, ["mlx5_0", "mlx5_1"], "infiniband",
     ["InfiniBand", "mlx5_0, mlx5_1"]),
    # InfiniBand devices without an ib* interface are no evidence of IB networking
    ({"RUNPOD_POD_ID": "p1"}, {}, PLAIN_IFACES, ["mlx5_0"], "runpod-global", ["RUNPOD_POD_ID"]),
    ({"RUNPOD_POD_ID": "p1"}, {}, PLAIN_IFACES, [], "runpod-global", ["RUNPOD_POD_ID"]),
    ({"HEAD_POD_ID": "h1"}, {}, PLAIN_IFACES, [], "runpod-global", ["HEAD_POD_ID"]),
    ({}, {}, POD_IFACES, [], "runpod-global", ["podnet1"]),
    ({}, {}, PLAIN_IFACES, [], "none", ["no RunPod or InfiniBand evidence"]),
    ({}, {}, {**PLAIN_IFACES, "ib0": ["192.168.50.2"]}, [], "none", ["no RunPod"]),
]


@pytest.mark.parametrize(("env", "flags", "ifaces", "ib", "preset", "words"), CHOICES)
def test_choose(env, flags, ifaces, ib, preset, words):
    name, reason = nccl.choose(config.build(flags, env), ifaces, ib)
    assert name == preset
    for word in words:
        assert word in reason


# --- effective ----------------------------------------------------------------------------------

def _effective(env: dict[str, str], ifaces=POD_IFACES, head_ip=None) -> nccl.NcclEnv:
    return nccl.effective(settings(**env), head_ip=head_ip, ifaces=ifaces, ib_devices=[])


def test_preset_applies_with_gloo_following_nccl():
    result = _effective({"PODAGENT_NCCL_PRESET": "runpod-global"})
    assert result.preset == "runpod-global"
    assert "PODAGENT_NCCL_PRESET" in result.reason
    assert dict(result.variables) == {**RUNPOD_GLOBAL, "GLOO_SOCKET_IFNAME": "podnet1"}
    assert result.user_wins == ()
    assert result.warnings == ()


@pytest.mark.parametrize(("user", "wins"), [
    ({"NCCL_SOCKET_IFNAME": "eth0"}, ("NCCL_SOCKET_IFNAME",)),
    ({"NCCL_IB_DISABLE": "0"}, ("NCCL_IB_DISABLE",)),
    ({"NCCL_IB_DISABLE": "0", "NCCL_LAUNCH_MODE": "PARALLEL"},
     ("NCCL_LAUNCH_MODE", "NCCL_IB_DISABLE")),
    ({"NCCL_DEBUG": "INFO"}, ()),
])
def test_users_own_variable_wins_per_variable(user, wins):
    result = _effective({"PODAGENT_NCCL_PRESET": "runpod-global", **user})
    assert set(result.user_wins) == set(wins)
    for key, value in RUNPOD_GLOBAL.items():
        if key in wins:
            assert key not in result.variables  # the user's value stays in the environment
        else:
            assert result.variables[key] == value
    assert "NCCL_DEBUG" not in result.variables  # podagent never copies unrelated variables


@pytest.mark.parametrize(("preset", "user", "gloo"), [
    ("runpod-global", {}, "podnet1"),
    ("runpod-cluster", {}, "ens1"),
    ("runpod-global", {"NCCL_SOCKET_IFNAME": "eth0"}, "eth0"),
    ("none", {"NCCL_SOCKET_IFNAME": "eth0"}, "eth0"),
    ("none", {"NCCL_SOCKET_IFNAME": "=eth0"}, "eth0"),
    ("none", {}, None),
    ("runpod-global", {"GLOO_SOCKET_IFNAME": "eth0"}, None),
    ("none", {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "lo"}, None),
    ("runpod-global", {"NCCL_SOCKET_IFNAME": "^docker,lo"}, None),
    ("none", {"NCCL_SOCKET_IFNAME": "^=docker0"}, None),
])
def test_gloo_follows_nccl_unless_the_user_set_gloo(preset, user, gloo):
    ifaces = {**POD_IFACES, "ens1": ["10.65.0.2"]}
    result = _effective({"PODAGENT_NCCL_PRESET": preset, **user}, ifaces=ifaces)
    assert result.variables.get("GLOO_SOCKET_IFNAME") == gloo
    if "GLOO_SOCKET_IFNAME" in user:
        assert "GLOO_SOCKET_IFNAME" not in result.variables


def test_exclusion_list_is_neither_copied_nor_checked():
    result = _effective({"NCCL_SOCKET_IFNAME": "^docker,lo"}, ifaces=PLAIN_IFACES)
    assert "GLOO_SOCKET_IFNAME" not in result.variables
    assert result.warnings == ()


def test_gloo_gets_an_exact_interface_name_for_a_prefix_spec():
    result = _effective({"NCCL_SOCKET_IFNAME": "eth"}, ifaces=PLAIN_IFACES)
    assert result.warnings == ()  # NCCL's prefix 'eth' matches eth0
    assert result.variables["GLOO_SOCKET_IFNAME"] == "eth0"


def test_empty_user_variable_does_not_beat_the_preset():
    result = _effective({"PODAGENT_NCCL_PRESET": "runpod-global", "NCCL_SOCKET_IFNAME": ""})
    assert result.variables["NCCL_SOCKET_IFNAME"] == "podnet1"
    assert "NCCL_SOCKET_IFNAME" not in result.user_wins


def test_missing_interface_warns_naming_the_interfaces_that_exist():
    ifaces = {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"], "eth1": []}
    result = _effective({"PODAGENT_NCCL_PRESET": "runpod-global"}, ifaces=ifaces)
    assert len(result.warnings) == 1
    warning = result.warnings[0]
    assert "NCCL_SOCKET_IFNAME=podnet1" in warning
    assert "eth0 (172.17.0.2)" in warning
    assert "lo (127.0.0.1)" in warning
    assert "eth1 (no IPv4)" in warning
    assert "route to the head" not in warning


def test_missing_interface_warning_names_the_route_to_the_head():
    ifaces = {"lo": ["127.0.0.1"], "eth0": ["172.17.0.2"]}
    result = _effective({"PODAGENT_NCCL_PRESET": "runpod-cluster"}, ifaces=ifaces,
                        head_ip="127.0.0.1")
    (warning,) = result.warnings
    assert "NCCL_SOCKET_IFNAME=ens1" in warning
    assert "the route to the head 127.0.0.1 goes through lo (127.0.0.1)" in warning


def test_users_missing_interface_is_warned_about_too():
    result = _effective({"NCCL_SOCKET_IFNAME": "=eth7"}, ifaces=PLAIN_IFACES)
    (warning,) = result.warnings
    assert "NCCL_SOCKET_IFNAME==eth7" in warning
    assert "eth0 (172.17.0.2)" in warning


def test_present_interface_gives_no_warning():
    assert _effective({"PODAGENT_NCCL_PRESET": "runpod-global"}).warnings == ()


def test_auto_choice_is_reported():
    result = nccl.effective(settings(RUNPOD_POD_ID="p1"), ifaces=POD_IFACES, ib_devices=[])
    assert result.preset == "runpod-global"
    assert "RUNPOD_POD_ID" in result.reason


# --- interfaces ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "names", "expected"), [
    ("eth", ["eth0", "eth1", "ens1", "lo"], ["eth0", "eth1"]),
    ("eth0", ["eth0", "eth0.5", "eth1"], ["eth0", "eth0.5"]),
    ("=eth0", ["eth0", "eth0.5", "eth1"], ["eth0"]),
    ("ens1,ib", ["ens1", "ib0", "ib1", "eth0"], ["ens1", "ib0", "ib1"]),
    ("=ens1,ib0", ["ens1", "ens10", "ib0", "ib01"], ["ens1", "ib0"]),
    (" eth0 , ", ["eth0", "lo"], ["eth0"]),
    ("podnet1", ["eth0", "lo"], []),
    ("=eth", ["eth0"], []),
    ("^docker", ["docker0", "eth0"], None),
    ("^=docker0", ["docker0", "eth0"], None),
])
def test_match_ifname(spec, names, expected):
    assert nccl.match_ifname(spec, names) == expected


def test_route_to_loopback_is_the_loopback_interface():
    name, source = nccl.route_to("127.0.0.1")
    assert source == "127.0.0.1"
    assert name is not None
    assert "127.0.0.1" in nccl.interfaces()[name]


@pytest.mark.parametrize(("ifaces", "expected"), [
    ({"myloop": ["127.0.0.1"], "eth0": ["172.17.0.2"]}, ("myloop", "127.0.0.1")),
    ({"eth0": ["172.17.0.2"]}, (None, "127.0.0.1")),
])
def test_route_to_names_the_interface_from_the_given_mapping(ifaces, expected):
    assert nccl.route_to("127.0.0.1", ifaces) == expected


def test_interfaces_lists_ipv4_addresses_only():
    found = nccl.interfaces()
    assert any("127.0.0.1" in addrs for addrs in found.values())
    assert all(":" not in a for addrs in found.values() for a in addrs)


def test_infiniband_devices(tmp_path):
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert nccl.infiniband_devices(tmp_path) == ["mlx5_0", "mlx5_1"]
    assert nccl.infiniband_devices(tmp_path / "absent") == []
