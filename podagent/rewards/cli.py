"""`podagent reward-server` (also `python -m podagent.rewards`): the click command."""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable
from typing import Any

import click

from podagent.config.fields import REWARD_FIRST, default_text
from podagent.errors import ConfigError, PodagentError, PortInUse
from podagent.rewards import settings as reward_settings
from podagent.rewards.dataset import DatasetError

EXIT_BAD_INPUT = 2  # as podagent's own table: a setting is invalid
EXIT_PORT_IN_USE = 9
EXIT_INTERNAL = 70

log = logging.getLogger("podagent.rewards")


def _fail(message: str, code: int) -> None:
    click.echo(f"podagent reward-server: error: {message}", err=True)
    sys.exit(code)


def reward_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """One option per setting, from settings.FIELDS (strings; parsed and checked by build);
    help shows those a first use needs (REWARD_FIRST), `podagent help settings
    reward-server` every one."""
    for field in reversed(reward_settings.FIELDS):
        default = default_text(field) or "unset"
        func = click.option(
            field.flag, field.attr, default=None, metavar="VALUE",
            hidden=field.attr not in REWARD_FIRST,
            help=f"{field.help} [env: {field.env}; default: {default}]")(func)
    return func


@click.command(name="reward-server",
               context_settings={"help_option_names": ["-h", "--help"],
                                 "max_content_width": 100},
               epilog=f"\b\nEvery setting ({len(reward_settings.FIELDS)}), each a flag and a "
                      f"variable:\npodagent help settings reward-server")
@reward_options
def reward_server(**flags: str | None) -> None:
    """Serve math rewards over HTTP: OpenRLHF's remote reward protocol.

    \b
    POST /get_reward {"query": [...], "prompts": [...], "labels": [...]}
      -> {"rewards", "scores", "format_rewards", "acc_rewards"}: one number per query
    GET /health -> {"status": "ok", "scoring": ..., counters}

    reward = accuracy + FORMAT_WEIGHT x format. --scoring openrlhf-m (default): OpenRLHF-M's
    server, item for item; boxed: the last \\boxed{} against the gold; openrlhf-boxed: upstream
    OpenRLHF's math reward function. --func FILE serves your reward_func(queries, prompts,
    labels) instead. docs/reward-server.md has every rule. SIGTERM or SIGINT: a clean stop
    (exit 0).
    """
    from podagent import extras

    try:
        extras.require("reward", "podagent reward-server")
    except PodagentError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    from podagent.rewards import server

    try:
        settings = reward_settings.build(flags)
    except ConfigError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    try:
        golds = server.load_golds(settings)
    except DatasetError as exc:
        rule = (f"must be a JSONL file of {settings.prompt_key!r} and {settings.answer_key!r} "
                f"records ({exc})")
        _fail(str(ConfigError(settings.source_name("dataset"), settings.dataset, rule)),
              EXIT_BAD_INPUT)
    from podagent.rewards.func import FuncError

    try:
        code = server.serve(settings, golds)
    except FuncError as exc:  # the file's import failed in the workers: bad input, one line
        _fail(str(ConfigError(settings.source_name("func"), settings.func or "", str(exc))),
              EXIT_BAD_INPUT)
    except OSError as exc:  # binding the address: the only OSError that reaches here
        if exc.errno == errno.EADDRINUSE:
            _fail(str(PortInUse(settings.port, settings.host, None)), EXIT_PORT_IN_USE)
        _fail(f"cannot listen on {settings.host}:{settings.port} ({exc.strerror or exc})",
              EXIT_BAD_INPUT)
    except PodagentError as exc:  # e.g. the verifier workers could not start
        _fail(str(exc), EXIT_INTERNAL)
    except Exception as exc:  # a bug: one line here, the traceback in the log just above
        log.exception("internal error")
        _fail(f"internal error: {type(exc).__name__}: {exc}", EXIT_INTERNAL)
    sys.exit(code)
