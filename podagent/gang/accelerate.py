"""`accelerate launch` on every pod, with the values that differ per machine worked out.

The user types `accelerate launch`'s own options and script; podagent drops the per-machine
options they typed (after checking the ones it can check), reads their config file to say what
it overrides, and puts its own values on the command line, where accelerate lets them win over
the config file's. accelerate is imported only inside functions: podagent's CLI checks that it
is installed before calling here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podagent.errors import ConfigError, InputError

PER_MACHINE = ("num_machines", "machine_rank", "main_process_ip", "main_process_port",
               "num_processes")

LAUNCHER_MODULE = "accelerate.commands.launch"
# Options that choose a launch with several processes; without one (and without a config
# distributed_type other than NO) accelerate starts a single process per machine.
MODE_FLAGS = ("multi_gpu", "use_deepspeed", "use_fsdp", "use_megatron_lm")
DEEPSPEED_LAUNCHER = "deepspeed_multinode_launcher"
# accelerate's default multi-node DeepSpeed launcher (pdsh) SSHes from one machine to the
# others; podagent starts the launcher on every pod itself.
STANDARD_LAUNCHER = "standard"
PLACEHOLDER_SCRIPT = "script.py"  # the parser wants a script; options are checked without one

REASONS = {
    "num_machines": "the head and the expected workers",
    "machine_rank": "this pod's machine rank",
    "main_process_ip": "the head's address",
    "main_process_port": "podagent's rendezvous port",
    "num_processes": "accelerate counts processes over all machines",
}


@dataclass(frozen=True)
class Option:
    dest: str  # argparse's name for it, e.g. machine_rank
    tokens: tuple[str, ...]  # as typed: ("--opt", "v"), ("--opt=v",) or ("--flag",)
    value: str | None  # None for a flag


@dataclass(frozen=True)
class LaunchArgs:
    options: tuple[str, ...]  # the user's launcher options, without the per-machine ones
    script: tuple[str, ...]  # training script and its args (empty: none given)
    config_file: str | None  # --config_file as typed
    given: Mapping[str, str]  # per-machine options typed by hand: PER_MACHINE key -> value
    # What accelerate's parser made of `options` (`plan` needs no parser, so podagent's own
    # process never imports accelerate, and with it torch): each option as typed, and which
    # of MODE_FLAGS and --cpu they set.
    typed: tuple[Option, ...] = ()
    flags: frozenset[str] = frozenset()


@dataclass(frozen=True)
class AcceleratePlan:
    argv: tuple[str, ...]
    env: Mapping[str, str]  # extra variables for the launcher's processes
    lines: tuple[str, ...]  # what podagent set or overrode, one line each


class _Refused(Exception):
    """argparse's complaint, raised instead of printing usage and exiting."""


def _parser():
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()

    def refuse(message: str):
        raise _Refused(message)

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def _walk(tokens: Sequence[str], parser) -> tuple[list[Option], tuple[str, ...]]:
    """The options before the script, each with its tokens, and the script with its args.
    The script starts at the first token that is not an option, or after a lone "--"."""
    options: list[Option] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return options, tuple(tokens[i + 1:])
        if not token.startswith("-") or token == "-":
            return options, tuple(tokens[i:])
        option, i = _one_option(tokens, i, parser)
        options.append(option)
    return options, ()


def _one_option(tokens: Sequence[str], i: int, parser) -> tuple[Option, int]:
    token = tokens[i]
    if token.startswith("--"):
        name, eq, attached = token.partition("=")
        has_attached = bool(eq)
    else:  # a short option, its value possibly attached: -t3
        name, attached = token[:2], token[2:]
        has_attached = bool(attached)
    action = parser._option_string_actions.get(name)
    if action is None:
        raise InputError(f"accelerate launch has no option {name}")
    if action.dest == "help":
        raise InputError("run `accelerate launch --help` for accelerate's options")
    if action.nargs == 0:
        if has_attached:
            raise InputError(f"accelerate launch option {name} takes no value (got {token!r})")
        return Option(action.dest, (token,), None), i + 1
    if has_attached:
        return Option(action.dest, (token,), attached), i + 1
    if i + 1 >= len(tokens):
        raise InputError(f"accelerate launch option {name} needs a value")
    return Option(action.dest, (token, tokens[i + 1]), tokens[i + 1]), i + 2


def _namespace(tokens: Sequence[str], parser):
    """accelerate's parse of the options alone: types checked as accelerate checks them."""
    try:
        return parser.parse_known_args([*tokens, PLACEHOLDER_SCRIPT])[0]
    except _Refused as exc:
        raise InputError(f"accelerate launch refuses the options: {_one_line(str(exc))}") from None


def split(user_args: Sequence[str]) -> LaunchArgs:
    """The user's `accelerate launch` arguments: options (less the per-machine ones), script,
    config file, and the per-machine values typed by hand."""
    parser = _parser()
    found, script = _walk(list(user_args), parser)
    # the per-machine values are podagent's to check (check_given): they leave the line
    kept = tuple(o for o in found if o.dest not in PER_MACHINE)
    namespace = _namespace([t for o in kept for t in o.tokens], parser)
    given = {o.dest: o.value for o in found if o.dest in PER_MACHINE and o.value is not None}
    options = tuple(t for o in kept for t in o.tokens)
    config = [o.value for o in found if o.dest == "config_file"]
    flags = frozenset(f for f in (*MODE_FLAGS, "cpu") if getattr(namespace, f, False))
    return LaunchArgs(options, script, config[-1] if config else None, given, kept, flags)


def _integer(option: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(option, value, "is not an integer") from None


def check_given(args: LaunchArgs, *, head: bool, workers: int, node_rank: int | None
                ) -> int | None:
    """The hand-given --num_machines and --machine_rank against what podagent works out; the
    requested machine rank, or None when none was given."""
    machines = args.given.get("num_machines")
    if machines is not None and _integer("--num_machines", machines) != workers + 1:
        raise ConfigError("--num_machines", machines,
                          f"contradicts EXPECTED_WORKERS={workers}: the run has {workers + 1} "
                          "machines (the head and its workers)")
    typed = args.given.get("machine_rank")
    if typed is None:
        return None
    rank = _integer("--machine_rank", typed)
    if head and rank != 0:
        raise ConfigError("--machine_rank", typed, "contradicts this pod's role: the head is "
                          "machine 0")
    if not head and workers < 1:
        raise ConfigError("--machine_rank", typed, "is given on a worker, but no worker is "
                          "expected (EXPECTED_WORKERS=0)")
    if not head and not 1 <= rank <= workers:
        raise ConfigError("--machine_rank", typed, f"must be 1..{workers} on a worker (machine 0 "
                          f"is the head; EXPECTED_WORKERS={workers})")
    if node_rank is not None and rank != node_rank:
        raise ConfigError("--machine_rank", typed, f"contradicts NODE_RANK={node_rank}")
    return rank


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _yaml_problem(exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return _one_line(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return f"{_one_line(problem)} at line {mark.line + 1}, column {mark.column + 1}"


def read_config(path: str) -> dict[str, object]:
    """accelerate's config file: YAML, or JSON when its name ends in .json (as accelerate
    reads it)."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("--config_file", path, "does not exist") from None
    except UnicodeDecodeError:
        raise ConfigError("--config_file", path, "is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError("--config_file", path, f"cannot be read: {exc.strerror}") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("--config_file", path, f"does not parse as JSON: {exc.msg} at line "
                              f"{exc.lineno}, column {exc.colno}") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("--config_file", path,
                              f"does not parse as YAML: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError("--config_file", path, "does not hold a mapping at its top level "
                          f"(found {type(data).__name__})")
    return data


def _chosen_mode(flags: frozenset[str], config: Mapping[str, Any]) -> str | None:
    """The multi-process mode the options or else the config choose (as accelerate decides:
    any mode option on the command line makes it ignore the config's distributed_type)."""
    for flag in MODE_FLAGS:
        if flag in flags:
            return flag
    kind = str(config.get("distributed_type") or "NO")
    if kind.upper() == "NO":
        return None
    return "use_deepspeed" if kind.upper() == "DEEPSPEED" else kind


def _differs(old: object, new: object) -> bool:
    return old is not None and str(old) != str(new)


def _override_lines(args: LaunchArgs, config: Mapping[str, Any], ours: Mapping[str, object]
                    ) -> list[str]:
    lines = []
    for key in PER_MACHINE:
        if _differs(config.get(key), ours[key]):
            lines.append(f"accelerate config {args.config_file}: {key} {config[key]} -> "
                         f"{ours[key]} ({REASONS[key]})")
        if _differs(args.given.get(key), ours[key]):
            lines.append(f"--{key} {args.given[key]} -> {ours[key]} ({REASONS[key]})")
    return lines


def _deepspeed_lines(args: LaunchArgs, config: Mapping[str, Any], typed: Sequence[Option]
                     ) -> list[str]:
    why = "podagent starts the launcher on every pod; pdsh would SSH to the others"
    lines = []
    section = config.get("deepspeed_config")
    old = section.get(DEEPSPEED_LAUNCHER) if isinstance(section, dict) else None
    if _differs(old, STANDARD_LAUNCHER):
        lines.append(f"accelerate config {args.config_file}: deepspeed_config."
                     f"{DEEPSPEED_LAUNCHER} {old} -> {STANDARD_LAUNCHER} ({why})")
    for option in typed:
        if _differs(option.value, STANDARD_LAUNCHER):
            lines.append(f"--{DEEPSPEED_LAUNCHER} {option.value} -> {STANDARD_LAUNCHER} ({why})")
    if not lines:
        lines.append(f"--{DEEPSPEED_LAUNCHER} {STANDARD_LAUNCHER} ({why})")
    return lines


def plan(args: LaunchArgs, *, nodes: int, machine_rank: int, main_ip: str, main_port: int,
         procs_per_node: int, gpus: int, script: Sequence[str]) -> AcceleratePlan:
    """The `accelerate launch` command line for this pod, the variables its processes need,
    and a line for each value podagent sets over the user's."""
    typed = args.typed
    config = read_config(args.config_file) if args.config_file else {}
    total = nodes * procs_per_node
    ours = {"num_machines": nodes, "machine_rank": machine_rank, "main_process_ip": main_ip,
            "main_process_port": main_port, "num_processes": total}
    mode = _chosen_mode(args.flags, config)
    if total > 1 and "cpu" in args.flags:
        raise ConfigError("--cpu", True, f"makes accelerate run one process per machine, not "
                          f"{total} together; drop it: on pods without GPUs podagent sets "
                          "ACCELERATE_USE_CPU=true")
    deepspeed = mode == "use_deepspeed" and nodes > 1
    launcher = [o for o in typed if o.dest == DEEPSPEED_LAUNCHER]
    # podagent's launcher choice replaces the user's rather than following it on the line
    options = [t for o in typed if not (deepspeed and o in launcher) for t in o.tokens]
    argv = [sys.executable, "-m", LAUNCHER_MODULE, *options]
    for key in PER_MACHINE:
        argv += [f"--{key}", str(ours[key])]
    lines = _override_lines(args, config, ours)
    if total > 1 and mode is None:
        argv.append("--multi_gpu")
        lines.append(f"--multi_gpu ({total} processes over {nodes} machines through torch's "
                     "launcher)")
    if deepspeed:
        argv += [f"--{DEEPSPEED_LAUNCHER}", STANDARD_LAUNCHER]
        lines += _deepspeed_lines(args, config, launcher)
    env = {}
    if gpus == 0:
        env["ACCELERATE_USE_CPU"] = "true"
        lines.append("ACCELERATE_USE_CPU=true: this pod has no GPU, and without it accelerate "
                     "would run each process alone (distributed type NO) instead of one run "
                     "over gloo")
    return AcceleratePlan(tuple([*argv, *script]), env, tuple(lines))
