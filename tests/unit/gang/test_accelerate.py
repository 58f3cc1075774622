"""`accelerate launch` with the per-machine values worked out: the user's arguments split with
accelerate's own parser, the hand-given values checked, the config file read, and the command
line each pod runs."""

from __future__ import annotations

import sys

import pytest

from podagent.errors import ConfigError, InputError
from podagent.gang.accelerate import LaunchArgs, check_given, plan, read_config, split

pytest.importorskip("accelerate")

HEAD = "10.0.0.1"
PORT = 29500


def _plan(args: LaunchArgs, **kw):
    values = dict(nodes=3, machine_rank=2, main_ip=HEAD, main_port=PORT, procs_per_node=8,
                  gpus=8, script=args.script)
    return plan(args, **{**values, **kw})


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


# --- split ---------------------------------------------------------------------------------

def test_split_options_from_script_and_per_machine_values_out():
    args = split(["--mixed_precision", "bf16", "--machine_rank", "2", "--num-processes=8",
                  "--config_file=acc.yaml", "--main_process_port", "1234",
                  "train.py", "--lr", "1e-4", "--num_processes", "3"])
    assert args.options == ("--mixed_precision", "bf16", "--config_file=acc.yaml")
    # the script's own arguments are the script's, even where they look like accelerate's
    assert args.script == ("train.py", "--lr", "1e-4", "--num_processes", "3")
    assert args.config_file == "acc.yaml"
    assert dict(args.given) == {"machine_rank": "2", "num_processes": "8",
                                "main_process_port": "1234"}


def test_split_space_form_config_and_flags_and_short_options():
    args = split(["-q", "--config_file", "c.yaml", "-t", "3", "--multi_gpu", "-m", "pkg.train"])
    assert args.options == ("-q", "--config_file", "c.yaml", "-t", "3", "--multi_gpu", "-m")
    assert args.script == ("pkg.train",)
    assert args.config_file == "c.yaml"
    assert dict(args.given) == {}


def test_split_leading_double_dash_is_dropped():
    args = split(["--num_machines=2", "--", "train.py", "--", "x"])
    assert args.options == ()
    assert args.script == ("train.py", "--", "x")
    assert dict(args.given) == {"num_machines": "2"}


def test_split_without_script():
    args = split(["--mixed_precision", "fp16"])
    assert args.script == ()
    assert split([]).options == ()


@pytest.mark.parametrize(("argv", "says"), [
    (["--no_such_option", "t.py"], "no option --no_such_option"),
    (["--num_cpu_threads_per_process", "many", "t.py"], "invalid int value: 'many'"),
    (["--machine_rank"], "--machine_rank needs a value"),
    (["--multi_gpu=yes", "t.py"], "takes no value"),
    (["--help"], "accelerate launch --help"),
    (["--mixed_precision", "fp12", "t.py"], "invalid choice"),
])
def test_split_refuses_bad_options_in_one_line(argv, says, capsys):
    with pytest.raises(InputError) as exc:
        split(argv)
    assert says in _one_line(exc)
    assert capsys.readouterr() == ("", "")  # argparse printed no usage


# --- check_given ---------------------------------------------------------------------------

@pytest.mark.parametrize(("typed", "head", "node_rank", "says"), [
    ("1", True, None, "--machine_rank='1' contradicts this pod's role: the head is machine 0"),
    ("0", False, None, "--machine_rank='0' must be 1..2 on a worker (machine 0 is the head; "
                       "EXPECTED_WORKERS=2)"),
    ("3", False, None, "--machine_rank='3' must be 1..2"),
    ("1", False, 2, "--machine_rank='1' contradicts NODE_RANK=2"),
    ("one", False, None, "--machine_rank='one' is not an integer"),
])
def test_check_given_machine_rank_contradictions(typed, head, node_rank, says):
    with pytest.raises(ConfigError) as exc:
        check_given(split([f"--machine_rank={typed}"]), head=head, workers=2, node_rank=node_rank)
    assert says in _one_line(exc)


@pytest.mark.parametrize("typed", ["2", "4", "x"])
def test_check_given_num_machines_must_be_workers_plus_one(typed):
    with pytest.raises(ConfigError) as exc:
        check_given(split(["--num_machines", typed]), head=True, workers=2, node_rank=None)
    line = _one_line(exc)
    assert line.startswith(f"--num_machines='{typed}'")
    assert "EXPECTED_WORKERS=2" in line or "not an integer" in line


def test_check_given_valid_values_pass():
    assert check_given(split(["t.py"]), head=True, workers=2, node_rank=None) is None
    assert check_given(split(["--machine_rank", "0", "--num_machines", "3"]), head=True,
                       workers=2, node_rank=None) == 0
    assert check_given(split(["--machine-rank=2"]), head=False, workers=2, node_rank=2) == 2
    assert check_given(split(["--machine_rank", "1"]), head=False, workers=2,
                       node_rank=None) == 1


# --- read_config ---------------------------------------------------------------------------

def test_read_config_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "a.yaml"
    yaml_file.write_text("distributed_type: MULTI_GPU\nnum_machines: 2\n")
    assert read_config(str(yaml_file)) == {"distributed_type": "MULTI_GPU", "num_machines": 2}
    json_file = tmp_path / "a.json"
    json_file.write_text('{"machine_rank": 1}')
    assert read_config(str(json_file)) == {"machine_rank": 1}


def test_read_config_bad_yaml_names_option_and_position(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("distributed_type: MULTI_GPU\nnum_machines: [2\nmachine_rank: 0\n")
    with pytest.raises(ConfigError) as exc:
        read_config(str(path))
    line = _one_line(exc)
    assert line.startswith(f"--config_file='{path}' does not parse as YAML:")
    assert "line 3, column" in line


def test_read_config_bad_json_missing_file_and_non_mapping(tmp_path):
    bad_json = tmp_path / "c.json"
    bad_json.write_text('{"a": }')
    with pytest.raises(ConfigError, match=r"does not parse as JSON: .* line 1, column 7"):
        read_config(str(bad_json))
    with pytest.raises(ConfigError) as exc:
        read_config(str(tmp_path / "absent.yaml"))
    assert _one_line(exc) == f"--config_file='{tmp_path / 'absent.yaml'}' does not exist"
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"not hold a mapping .*found list"):
        read_config(str(listing))


# --- plan ----------------------------------------------------------------------------------

def test_plan_argv_order_and_per_machine_values_replaced():
    args = split(["--mixed_precision", "bf16", "--machine_rank", "2", "--num_processes", "8",
                  "--main_process_ip=1.2.3.4", "train.py", "--epochs", "1"])
    result = _plan(args)
    assert result.argv == (
        sys.executable, "-m", "accelerate.commands.launch", "--mixed_precision", "bf16",
        "--num_machines", "3", "--machine_rank", "2", "--main_process_ip", HEAD,
        "--main_process_port", str(PORT), "--num_processes", "24", "--multi_gpu",
        "train.py", "--epochs", "1")
    assert dict(result.env) == {}
    assert "--num_processes 8 -> 24 (accelerate counts processes over all machines)" \
        in result.lines
    assert f"--main_process_ip 1.2.3.4 -> {HEAD} (the head's address)" in result.lines
    assert not any(line.startswith("--machine_rank") for line in result.lines)  # it was 2


def test_plan_runs_the_script_it_is_given():
    args = split(["train.py", "--x"])
    result = _plan(args, script=("check.py", "--out", "d"))
    assert result.argv[-3:] == ("check.py", "--out", "d")
    assert "train.py" not in result.argv


def test_plan_lines_for_config_keys_that_differ_only(tmp_path):
    config = tmp_path / "acc.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_machines: 3\nmachine_rank: 0\n"
                      f"main_process_ip: null\nmain_process_port: {PORT}\nnum_processes: 8\n")
    args = split(["--config_file", str(config), "train.py"])
    result = _plan(args)
    assert list(result.lines) == [
        f"accelerate config {config}: machine_rank 0 -> 2 (this pod's machine rank)",
        f"accelerate config {config}: num_processes 8 -> 24 "
        "(accelerate counts processes over all machines)"]
    # the config chooses the mode: no --multi_gpu of podagent's, and the file stays on the line
    assert "--multi_gpu" not in result.argv
    assert result.argv[3:5] == ("--config_file", str(config))


def test_plan_cpu_pods_get_accelerate_use_cpu():
    result = _plan(split(["t.py"]), nodes=2, procs_per_node=2, gpus=0)
    assert dict(result.env) == {"ACCELERATE_USE_CPU": "true"}
    line = next(line for line in result.lines if line.startswith("ACCELERATE_USE_CPU"))
    assert "no GPU" in line and "alone" in line
    assert "--multi_gpu" in result.argv


@pytest.mark.parametrize(("options", "config", "multi_gpu"), [
    ([], None, True),
    (["--use_fsdp"], None, False),
    (["--multi_gpu"], None, False),  # the user's own, once
    ([], "distributed_type: NO\n", True),
    ([], "distributed_type: FSDP\n", False),
    (["--use_megatron_lm"], "distributed_type: NO\n", False),
])
def test_plan_multi_gpu_only_where_nothing_chose_a_mode(tmp_path, options, config, multi_gpu):
    if config is not None:
        path = tmp_path / "c.yaml"
        path.write_text(config)
        options = [*options, "--config_file", str(path)]
    result = _plan(split([*options, "t.py"]))
    assert result.argv.count("--multi_gpu") == (1 if multi_gpu or "--multi_gpu" in options
                                                 else 0)
    podagents = any(line.startswith("--multi_gpu") for line in result.lines)
    assert podagents == multi_gpu


def test_plan_one_process_in_all_adds_no_multi_gpu():
    result = _plan(split(["t.py"]), nodes=1, procs_per_node=1, gpus=1)
    assert "--multi_gpu" not in result.argv
    assert result.argv[result.argv.index("--num_processes") + 1] == "1"


def test_plan_deepspeed_on_several_machines_launches_per_machine(tmp_path):
    config = tmp_path / "ds.yaml"
    config.write_text("distributed_type: DEEPSPEED\n"
                      "deepspeed_config:\n  deepspeed_multinode_launcher: pdsh\n  zero_stage: 2\n")
    result = _plan(split(["--config_file", str(config), "t.py"]))
    assert result.argv[-3:] == ("--deepspeed_multinode_launcher", "standard", "t.py")
    assert "--multi_gpu" not in result.argv
    assert any(f"accelerate config {config}: deepspeed_config.deepspeed_multinode_launcher "
               "pdsh -> standard" in line for line in result.lines)


def test_plan_deepspeed_launcher_typed_by_hand_is_replaced():
    args = split(["--use_deepspeed", "--deepspeed_multinode_launcher", "pdsh", "t.py"])
    result = _plan(args)
    assert result.argv.count("--deepspeed_multinode_launcher") == 1
    assert "pdsh" not in result.argv
    assert "--deepspeed_multinode_launcher pdsh -> standard" in " ".join(result.lines)


def test_plan_deepspeed_on_one_machine_keeps_accelerates_launcher():
    result = _plan(split(["--use_deepspeed", "t.py"]), nodes=1)
    assert "--deepspeed_multinode_launcher" not in result.argv


def test_plan_refuses_cpu_flag_for_several_processes():
    with pytest.raises(ConfigError) as exc:
        _plan(split(["--cpu", "t.py"]), gpus=0)
    assert _one_line(exc).startswith("--cpu=True makes accelerate run one process per machine")
