"""The command line: it parses, calls one function of the package per command, and ends a
command's error with one line and its code from the one table (run/exits.py). A pod's role
reports its own errors, through the start (run/start.py)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

import click

from podagent import __version__, config, errors
from podagent.choices import RAY_LAUNCHER
from podagent.config.fields import (
    FIELD_BY_ATTR,
    FIELDS,
    FIRST_RUN,
    GROUPS,
    REWARD_FIELDS,
    REWARD_SERVER_GROUP,
    default_text,
)
from podagent.config.parsers import preset_name, run_name
from podagent.platform.roles import Role, detect_role
from podagent.ray_access import ray_compat
from podagent.run.exits import EXIT_INTERNAL, EXIT_OK, exit_code, restartable
from podagent.waiting import Signals

if TYPE_CHECKING:
    from podagent.report import Reporter

LEAVE_FLUSH = 1.0  # seconds the last output gets on a second signal (a reader may be stopped)
def _boundary(command: Callable[..., Any] | None = None, *, pod: bool = False) -> Any:
    """The one place a command's error ends it: podagent's errors as one line on stderr and the
    table's code (a signal's as 128 + its number, without a line: whoever sent it knows); a bug
    as its traceback and 70. A role that runs reports its own errors (to its log) and returns
    its code. `pod`: the command is a pod's own podagent, whose bad input, found before its
    settings exist, ends as any final code does on RunPod (the pod stops itself)."""

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except errors.PodagentError as exc:
                _say_error(exc)
                code = exit_code(exc)
                if pod and not isinstance(exc, errors.Interrupted) and not restartable(code) \
                        and not _dry_run_asked():
                    from podagent.run import after_run

                    after_run.settle_unconfigured(os.environ, code, _say_err)
                sys.exit(code)
            except (click.exceptions.ClickException, click.exceptions.Exit,
                    click.exceptions.Abort):
                raise  # click's own: it says them and exits as it does
            except Exception:
                with contextlib.suppress(OSError):
                    traceback.print_exc()
                sys.exit(EXIT_INTERNAL)

        return guarded

    return wrap if command is None else wrap(command)


def _say_error(exc: errors.PodagentError) -> None:
    """podagent's error as its one line (a signal's says nothing: whoever sent it knows)."""
    if not isinstance(exc, errors.Interrupted):
        _say_err(f"podagent: error: {exc}")


def _say_err(line: str) -> None:
    """A line on stderr, best effort: a stderr that broke (a closed terminal, `2>&1 | tee`
    gone) must not turn the table's code into click's 1."""
    try:
        click.echo(line, err=True)
    except OSError:
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stderr.fileno())
            os.close(devnull)


def _dry_run_asked() -> bool:
    """Whether the command under way is a dry run (its own --dry-run or its group's)."""
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if ctx.params.get("dry_run"):
            return True
        ctx = ctx.parent
    return False


def settings_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """One option per setting, generated from FIELDS (strings; parsed by config). Help
    shows the ones a first run needs (FIRST_RUN); every one is taken, and `podagent
    help settings` lists them all."""
    for field in reversed(FIELDS):
        shown = {"hidden": field.attr not in FIRST_RUN,
                 "help": f"{field.help} [env: {field.env}]"}
        if field.is_flag:
            func = click.option(field.flag, field.attr, is_flag=True, flag_value="1",
                                default=None, **shown)(func)
            continue
        func = click.option(field.flag, field.attr, default=None, metavar="VALUE",
                            **shown)(func)
    return func


def _settings_pointer() -> str:
    groups = "|".join(group.name for group in (*GROUPS, REWARD_SERVER_GROUP))
    return (f"Every setting ({len(FIELDS)}), each a flag and a variable: podagent help "
            f"settings [{groups}]")


class _Command(click.Command):
    """A command whose help says where the settings it takes but does not show are."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        if any(getattr(param, "hidden", False) and param.name in FIELD_BY_ATTR
               for param in self.params):
            formatter.write_paragraph()
            formatter.write_text(_settings_pointer())


class _Face(click.Group):
    """podagent's own help, one screen: what it does, its commands, the settings a first run
    needs, and where the rest are."""

    command_class = _Command

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.format_commands(ctx, formatter)
        records = [record for param in self.get_params(ctx)
                   if (record := param.get_help_record(ctx)) is not None]
        with formatter.section("Options, and the settings a first run needs"):
            formatter.write_dl(records)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_paragraph()
        formatter.write_text(_settings_pointer() + "; a command's own: podagent COMMAND --help.")


def settings_help(group: str | None) -> str:
    """`podagent help settings [GROUP]`: every setting of the group (all groups without one),
    its flag, variable, default and meaning."""
    server = REWARD_SERVER_GROUP
    tables = {**{each.name: (each, [f for f in FIELDS if f.group == each.name])
                 for each in GROUPS},
              server.name: (server, list(REWARD_FIELDS))}
    if group is not None and group not in tables:
        raise errors.ConfigError("GROUP", group, f"is not a group of settings: one of "
                                                 f"{', '.join(tables)}")
    formatter = click.HelpFormatter(max_width=CONTEXT["max_content_width"])
    for name, (each, fields) in tables.items():
        if group not in (None, name):
            continue
        rows = []
        for field in fields:
            default = default_text(field)
            rows.append((f"{field.flag} / {field.env}",
                         field.help + (f" [default: {default}]" if default else "")))
        with formatter.section(f"{each.title} (podagent help settings {name})"):
            formatter.write_dl(rows)
    return formatter.getvalue()


def _flags(ctx: click.Context, own: dict[str, Any]) -> dict[str, str | None]:
    """Group-level flags, overridden by the subcommand's own."""
    merged = dict((ctx.parent.params if ctx.parent else {}) or {})
    merged.update({k: v for k, v in own.items() if v is not None})
    return {k: v for k, v in merged.items() if k in FIELD_BY_ATTR}


def _build(flags: dict[str, str | None],
           job_argv: tuple[str, ...] | None = None) -> config.Settings:
    return config.build(flags, os.environ, job_argv)


def _ray_role(settings: config.Settings, explicit: Role | None, launcher_args: tuple[str, ...],
              data_check: bool, loader: str | None) -> Any:
    from podagent.cluster.run import RayRole

    return RayRole(settings, explicit)


def _gang_role(settings: config.Settings, explicit: Role | None,
               launcher_args: tuple[str, ...], data_check: bool, loader: str | None) -> Any:
    from podagent.gang.run import GangRole

    return GangRole(settings, launcher_args, data_check, loader)


# What runs a pod's role, by PODAGENT_LAUNCHER (`podagent head|worker` name Ray, `podagent
# torchrun|accelerate` their launcher): each makes the role the kernel's start runs.
ENGINES: dict[str, Callable[[config.Settings, Role | None, tuple[str, ...], bool, str | None],
                            Any]] = {
    RAY_LAUNCHER: _ray_role, "torchrun": _gang_role, "accelerate": _gang_role}


def _start(settings: config.Settings, explicit: Role | None = None, dry_run: bool = False,
           launcher_args: tuple[str, ...] = (), data_check: bool = False,
           loader: str | None = None) -> None:
    """This pod's role, started as every role is (run/start.py); exits with its code."""
    from podagent.run import start

    make = ENGINES[settings.launcher]
    sys.exit(start.start(settings, lambda: make(settings, explicit, launcher_args, data_check,
                                                loader), dry_run=dry_run))


def _run_role(flags: dict[str, str | None], explicit: Role | None,
              job_argv: tuple[str, ...] | None = None, dry_run: bool = False) -> None:
    """`podagent head|worker`: a role of the Ray engine, whatever PODAGENT_LAUNCHER says."""
    # Built so: what the settings derive from the launcher (the job's resume flag) is Ray's.
    _start(_build({**flags, "launcher": RAY_LAUNCHER}, job_argv), explicit, dry_run)


CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


dry_run_option = click.option(
    "--dry-run", is_flag=True, default=None,
    help="Print what podagent would do on this pod (role, preset, Ray command) and exit 0.")


def _dry(ctx: click.Context, own: bool | None) -> bool:
    parent = ctx.parent.params.get("dry_run") if ctx.parent else None
    return bool(own or parent)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    ray = ray_compat.installed()
    click.echo(f"podagent, version {__version__} ({ray or 'no Ray installed'})")
    ctx.exit()


@click.group(cls=_Face, invoke_without_command=True, context_settings=CONTEXT)
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="Show podagent's version and the image's Ray.")
@settings_options
@dry_run_option
@click.pass_context
@_boundary(pod=True)
def main(ctx: click.Context, dry_run: bool | None, **flags: Any) -> None:
    """Multi-pod training on RunPod: the same image and command on every pod brings up a Ray
    cluster (or runs torchrun / accelerate on every pod), runs the job, restarts it from its
    checkpoint when a pod is lost, and stops the pods when it is over. From a laptop, `podagent
    up` creates the pods, follows the run and terminates them.

    With no command, podagent works out this pod's role (see `podagent env`) and acts.
    """
    if ctx.invoked_subcommand is None:
        settings = _build(_flags(ctx, flags))
        if settings.launcher != RAY_LAUNCHER and not settings.job:  # the launcher's args
            raise errors.InputError(
                f"{settings.source_name('launcher')}={settings.launcher} needs the job: "
                f"PODAGENT_JOB='[{settings.launcher.upper()} OPTIONS] [--] SCRIPT ARGS'")
        _start(settings, dry_run=bool(dry_run), launcher_args=settings.job or ())


@main.command("help", context_settings=CONTEXT)
@click.argument("topic", nargs=-1)
@click.pass_context
@_boundary
def help_command(ctx: click.Context, topic: tuple[str, ...]) -> None:
    """This help; `help settings [GROUP]`: every setting, by group; `help COMMAND`: that
    command's help."""
    root = ctx.find_root()
    if not topic:
        click.echo(root.get_help())
    elif topic[0] == "settings" and len(topic) <= 2:
        click.echo(settings_help(topic[1] if len(topic) == 2 else None), nl=False)
    elif len(topic) == 1 and topic[0] in main.commands:
        command = main.commands[topic[0]]
        with click.Context(command, info_name=topic[0], parent=root) as sub:
            click.echo(command.get_help(sub))
    else:
        raise errors.ConfigError("TOPIC", " ".join(topic),
                                 f"is not a help topic: settings [GROUP] or a command "
                                 f"({', '.join(sorted(main.commands))})")


@main.command(context_settings={**CONTEXT, "ignore_unknown_options": True})
@settings_options
@dry_run_option
@click.argument("entrypoint", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
@_boundary(pod=True)
def head(ctx: click.Context, entrypoint: tuple[str, ...], dry_run: bool | None,
         **flags: Any) -> None:
    """Be the head: start Ray, wait for the workers, run the job (ENTRYPOINT after --)."""
    _run_role(_flags(ctx, flags), Role.HEAD, tuple(entrypoint) or None,
              dry_run=_dry(ctx, dry_run))


@main.command(context_settings=CONTEXT)
@settings_options
@dry_run_option
@click.pass_context
@_boundary(pod=True)
def worker(ctx: click.Context, dry_run: bool | None, **flags: Any) -> None:
    """Be a worker: find the head, join its Ray, stay until the head closes the run."""
    _run_role(_flags(ctx, flags), Role.WORKER, dry_run=_dry(ctx, dry_run))


@main.command(name="env", context_settings=CONTEXT)
@settings_options
@click.option("--preset", "preset_override", default=None, metavar="NAME",
              help="Show this NCCL preset instead of the chosen one.")
@click.option("--export", "as_export", is_flag=True, help="Print shell `export` lines.")
@click.pass_context
@_boundary
def env_command(ctx: click.Context, preset_override: str | None, as_export: bool,
                **flags: Any) -> None:
    """Print the environment podagent would apply on this pod (secrets redacted)."""
    from podagent.platform import pod

    merged = _flags(ctx, flags)
    if preset_override is not None:
        try:
            merged["nccl_preset"] = preset_name(preset_override.strip())
        except ValueError as exc:
            raise errors.ConfigError("--preset", preset_override, str(exc)) from None
    for line in pod.environment_lines(_build(merged), as_export):
        click.echo(line)


@main.command(context_settings=CONTEXT)
@settings_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--cluster", is_flag=True,
              help="Run the cluster check job on the running cluster instead (from any pod).")
@click.pass_context
@_boundary
def check(ctx: click.Context, as_json: bool, cluster: bool, **flags: Any) -> None:
    """Preflight this pod: GPUs, the preset's interface, /dev/shm, open files, disk, and on a
    worker the head's DNS and ports. Exit 0 when nothing is fatal, 1 otherwise."""
    settings, role, reporter = _asking(ctx, flags, stream=sys.stdout)
    if cluster:
        from podagent.checks import cluster_run

        sys.exit(EXIT_OK if cluster_run.check_cluster(settings, role, reporter) else 1)
    from podagent.checks import preflight

    results = preflight.run_checks(settings, role)
    click.echo(preflight.to_json(results) if as_json else preflight.render_table(results))
    sys.exit(1 if preflight.fatal(results) else EXIT_OK)


def _asking(ctx: click.Context, flags: dict[str, Any], stream: TextIO | None = None
            ) -> tuple[config.Settings, Role, Reporter]:
    """Settings, role and a screen-only reporter for the commands that ask the cluster."""
    from podagent.run.shell import reporter_for

    # gRPC's core logs connection chatter (a GOAWAY when the head goes down) unless told not
    # to; it reads this when first loaded, which is after this line for these commands.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    settings = _build(_flags(ctx, flags))
    role = detect_role(settings).role
    return settings, role, reporter_for(settings, role.value, stream=stream or sys.stderr)


@main.command(context_settings=CONTEXT)
@settings_options
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--local", is_flag=True,
              help="Only this pod: exit 0 when its podagent runs (a container HEALTHCHECK).")
@click.pass_context
@_boundary
def status(ctx: click.Context, as_json: bool, local: bool, **flags: Any) -> None:
    """From any pod: the head, Ray's nodes (IP, pod, GPUs, alive), the job, the reward server."""
    settings, role, reporter = _asking(ctx, flags)
    from podagent.control import status as status_mod

    if local:
        healthy, line = status_mod.local_health(settings)
        click.echo(line)
        sys.exit(EXIT_OK if healthy else 1)
    from podagent.control.channel import open_channel

    channel = open_channel(settings, role, reporter)
    state = channel.status()
    click.echo(json.dumps(state, indent=2) if as_json else channel.render(state))


@main.command(context_settings=CONTEXT)
@settings_options
@click.option("--timeout", "wait", type=click.FloatRange(1, 3600), default=300.0,
              show_default=True, help="Seconds to wait for the cluster to go down.")
@click.pass_context
@_boundary
def stop(ctx: click.Context, wait: float, **flags: Any) -> None:
    """From any pod: stop the job and bring the whole cluster down in order (workers leave,
    then the head). The run is over: every podagent then exits 0, stays up idle or stops its
    pod, as PODAGENT_AFTER_RUN says."""
    settings, role, reporter = _asking(ctx, flags)
    from podagent.control.channel import open_channel

    channel = open_channel(settings, role, reporter)
    reporter.say(channel.stop(by=settings.pod_name, timeout=wait))


@main.command(context_settings=CONTEXT)
@settings_options
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the job ends.")
@click.pass_context
@_boundary
def logs(ctx: click.Context, follow: bool, **flags: Any) -> None:
    """From any pod: the run's job log (from the head's Jobs API; in a run without Ray, the
    head's training output)."""
    settings, role, reporter = _asking(ctx, flags)
    from podagent.control.channel import open_channel

    signals = Signals()
    signals.install()
    channel = open_channel(settings, role, reporter)
    channel.logs(follow, lambda text: click.echo(text, nl=False), signals)


# A launcher's own options pass through untouched: podagent's come first, and parsing stops at
# the first argument that is not one of them.
LAUNCHER_CONTEXT = {**CONTEXT, "ignore_unknown_options": True, "allow_interspersed_args": False}


def launcher_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed((
        dry_run_option,
        click.option("--data-check", is_flag=True, default=False,
                     help="First run a tiny data loader through the same launcher on every "
                          "pod and stop (exit 23) when ranks see the same samples; then the "
                          "script, if one is given."),
        click.option("--loader", default=None, metavar="FILE:FUNC",
                     help="--data-check: FUNC() in FILE builds your data loader, as your "
                          "training does (default: a small one, distributed the launcher's "
                          "way)."),
        click.argument("launcher_args", nargs=-1, type=click.UNPROCESSED),
        click.pass_context,
    )):
        func = option(func)
    return func


def _launcher_settings(ctx: click.Context, name: str, launcher_args: tuple[str, ...]
                       ) -> config.Settings:
    """The settings of `podagent torchrun|accelerate ARGS`, as PODAGENT_LAUNCHER and
    PODAGENT_JOB would give them: the job's trainer (and so how it resumes) is read from
    the launcher's arguments."""
    return _build(_flags(ctx, {"launcher": name}), launcher_args or None)


@main.command(context_settings=LAUNCHER_CONTEXT)
@launcher_options
@_boundary(pod=True)
def torchrun(ctx: click.Context, launcher_args: tuple[str, ...], dry_run: bool | None,
             data_check: bool, loader: str | None) -> None:
    """Run torchrun on every pod with the ranks worked out: [TORCHRUN OPTIONS] [--] SCRIPT ARGS.

    The head's address comes from the same discovery as the Ray path, --nnodes from the expected
    workers, --nproc-per-node from the GPUs, and torch's c10d rendezvous at the head gives each
    node its rank. torchrun starts once every node came: the head waits up to
    PODAGENT_WORKER_TIMEOUT for its workers, a worker up to PODAGENT_HEAD_TIMEOUT for the head.
    Options you pass win over podagent's. podagent stays and watches: a pod lost, or a
    training that fails on one pod, stops the training on every pod within seconds.
    """
    _start(_launcher_settings(ctx, "torchrun", launcher_args), dry_run=_dry(ctx, dry_run),
           launcher_args=launcher_args, data_check=data_check, loader=loader)


@main.command(context_settings=LAUNCHER_CONTEXT)
@launcher_options
@_boundary(pod=True)
def accelerate(ctx: click.Context, launcher_args: tuple[str, ...], dry_run: bool | None,
               data_check: bool, loader: str | None) -> None:
    """Run `accelerate launch` on every pod: [ACCELERATE OPTIONS] [--] SCRIPT ARGS.

    podagent sets --num_machines, this pod's --machine_rank (the head is 0), --main_process_ip
    and --main_process_port (the head's PODAGENT_RENDEZVOUS_PORT) and --num_processes; your
    --config_file is kept and each of its per-machine values podagent overrides is said.
    Supervised as `podagent torchrun` is.
    """
    _start(_launcher_settings(ctx, "accelerate", launcher_args), dry_run=_dry(ctx, dry_run),
           launcher_args=launcher_args, data_check=data_check, loader=loader)


@main.command(context_settings=CONTEXT)
@_boundary
def token() -> None:
    """Print a fresh random cluster token: put it in the pod template as a secret
    (PODAGENT_TOKEN) on every pod; Ray then refuses anyone without it."""
    import secrets

    click.echo(secrets.token_hex(32))


# --- from the user's machine: up, down, ls -------------------------------------------------

def _launch_key(key_file: str | None) -> str:
    from podagent.launch import commands

    return commands.api_key(os.environ, key_file)


def _launched(action: Callable[[Any], int]) -> None:
    """Runs up/down/ls under their signal handling (launch/interrupts.py): a first SIGINT,
    SIGTERM or SIGHUP ends what they do (up then terminates its pods), a second leaves. Their
    errors go to the boundary as any command's."""
    from podagent.launch.interrupts import Interrupts, Leave, signum_of

    interrupts = Interrupts().install()
    try:
        code = action(interrupts)
    except (KeyboardInterrupt, Leave) as exc:  # before anything was created, or in down/ls
        code = 128 + signum_of(exc)
    except errors.PodagentError as exc:
        if interrupts.first is None:
            raise
        _say_error(exc)
        code = exit_code(exc)
    if interrupts.first is not None:
        # Once a signal came, Python's exit may wait forever: the KeyboardInterrupt may have
        # landed inside a library while it held a lock, which the library's own finalizer then
        # waits for at exit (seen: `up` stopped after RunPod's answer to a list, forever in
        # urllib3's pool close, on its queue's mutex). Leave, too, means now: the exit would
        # first wait for the calls still on their way (a create on the creator's threads, up
        # to its deadline); what they asked for is in the record, and `podagent down RUN`
        # finds it by name. Everything this command does is done by now (the clean-up ran).
        # What is said so far goes out, unless nobody reads it (a stopped `| less`): the flush
        # is given a second on a thread of its own, never the exit.
        def flush() -> None:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()

        flushing = threading.Thread(target=flush, daemon=True)
        flushing.start()
        flushing.join(LEAVE_FLUSH)
        os._exit(code)
    sys.exit(code)


key_file_option = click.option(
    "--api-key-file", "key_file", default=None, metavar="FILE",
    help="A file holding the RunPod API key (else RUNPOD_API_KEY, or RUNPOD_API_KEY_FILE); "
         "never the key itself on the command line.")


def _up_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`up`'s options as launch/options.py declares them."""
    from podagent.launch.options import UP_OPTIONS

    for option in reversed(UP_OPTIONS):
        kind = option.kind
        extra: dict[str, Any] = (
            {"is_flag": True} if kind is bool else
            {"type": click.Choice(kind)} if isinstance(kind, tuple) else {"type": kind})
        if option.default not in (None, (), False, ""):
            extra["show_default"] = True
        command = click.option(*option.flags, option.attr, default=option.default,
                               metavar=option.metavar, multiple=option.multiple,
                               help=option.help, **extra)(command)
    return command


@main.command(context_settings={**CONTEXT, "ignore_unknown_options": False})
@_up_options
@click.option("--list-gpus", is_flag=True, help="List RunPod's GPU types and exit.")
@key_file_option
@click.argument("job", nargs=-1, type=click.UNPROCESSED)
@_boundary
def up(key_file: str | None, list_gpus: bool, job: tuple[str, ...], **shape: Any) -> None:
    """From this machine: create the pods at RunPod, bring the cluster up, follow the run, and
    terminate the pods at the end. The job's command goes after --. `podagent up --name RUN`
    alone follows a run that exists (a detached one) to its end.

    \b
    RUNPOD_API_KEY=... podagent up --image ghcr.io/me/trainer:1 --gpu 'NVIDIA H100 80GB HBM3' \\
        --gpus 8 --pods 2 -- python -m openrlhf.cli.train_ppo_ray ...
    """
    from podagent.launch import commands
    from podagent.launch import spec as specs

    key = _launch_key(key_file)
    url = commands.api_url(os.environ)
    if list_gpus:
        def listing(_interrupts: Any) -> int:
            api = commands.client(key, url, lambda line: click.echo(line, err=True))
            for gpu in sorted(api.gpu_types(), key=lambda g: str(g.get("id"))):
                price = (gpu.get("price") or {}).get("secure")
                click.echo(f"{gpu.get('id')!s:40} {gpu.get('memory')!s:>4} GB  "
                           f"max {(gpu.get('maxCount') or {}).get('secure')}/pod  "
                           f"${price}/GPU/h")
            return EXIT_OK
        _launched(listing)
    if shape["run"] and not shape["image"] and not shape["template"] and not job:
        # `up --name RUN` alone: follow the run that exists; never create anything.
        state_dir = specs.default_state_dir(os.environ)
        spec = commands.reattach_spec(shape["run"], key, url, state_dir, shape["api_timeout"],
                                      None)
        _launched(lambda interrupts: commands.up(spec, key, interrupts,
                                                 follow_only=True))
    spec = specs.build(**shape, job=job, api_url=url, state_dir=None)
    _launched(lambda interrupts: commands.up(spec, key, interrupts))


@main.command(context_settings=CONTEXT)
@click.argument("run")
@click.option("--timeout", type=click.FloatRange(1, 86400), default=120.0, show_default=True,
              metavar="SECONDS", help="How long RunPod gets to have every pod gone; each API "
              "call's retries end within it too.")
@click.option("--volume", "volume", is_flag=True,
              help="Delete the run's network volume too, with its checkpoints and model "
                   "(asked first; --yes answers yes).")
@click.option("--yes", "yes", is_flag=True, help="Do not ask before deleting the volume.")
@key_file_option
@_boundary
def down(run: str, timeout: float, volume: bool, yes: bool, key_file: str | None) -> None:
    """Terminate every pod of run RUN (found by this machine's record, their names and their
    label, so also after a crash mid-create). The run's network volume is kept unless
    --volume."""
    from podagent.launch import commands
    from podagent.launch import spec as specs

    try:
        run_name(run)
    except ValueError as exc:
        raise errors.InputError(f"RUN={run!r}: {exc}") from None
    key = _launch_key(key_file)

    def confirm(question: str) -> bool:
        """Asked once the pods are gone: a script without --yes still ends their billing."""
        if yes:
            return True
        if not sys.stdin.isatty():
            raise errors.InputError("--volume deletes the run's checkpoints and model for "
                                    "good: add --yes to confirm it where nobody can be asked "
                                    "(no terminal); the volume is kept")
        return click.confirm(question, default=False)

    _launched(lambda _interrupts: commands.down(
        run, key, commands.api_url(os.environ), specs.default_state_dir(os.environ),
        lambda line: click.echo(f"[down] {line}"), timeout,
        volume=confirm if volume else None) and EXIT_OK)


@main.command(name="ls", context_settings=CONTEXT)
@key_file_option
@_boundary
def ls_command(key_file: str | None) -> None:
    """The runs `podagent up` started and their pods at RunPod, with their cost per hour."""
    from podagent.launch import commands
    from podagent.launch import spec as specs

    key = _launch_key(key_file)
    _launched(lambda _interrupts: commands.ls(key, commands.api_url(os.environ),
                                              specs.default_state_dir(os.environ)) and EXIT_OK)


def _register_reward_server() -> None:
    from podagent.rewards.cli import reward_server

    main.add_command(reward_server, name="reward-server")


_register_reward_server()

if __name__ == "__main__":
    main()
