"""`podagent reward-server` (also `python -m podagent.rewards`): the click command."""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable
from typing import Any

import click

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


def _default(field: reward_settings.Field) -> str:
    if field.default_doc:
        return field.default_doc
    if field.default is None:
        return "unset"
    if isinstance(field.default, bool):
        return str(int(field.default))
    return f"{field.default:g}" if isinstance(field.default, float) else str(field.default)


def reward_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """One option per setting, from settings.FIELDS (strings; parsed and checked by build)."""
    for field in reversed(reward_settings.FIELDS):
        func = click.option(
            field.flag, field.attr, default=None, metavar="VALUE",
            help=f"{field.help} [env: {field.env}; default: {_default(field)}]")(func)
    return func


@click.command(name="reward-server",
               context_settings={"help_option_names": ["-h", "--help"],
                                 "max_content_width": 100})
@reward_options
def reward_server(**flags: str | None) -> None:
    """Serve math rewards over HTTP: OpenRLHF's remote reward protocol.

    \b
    POST /get_reward {"query": [...], "prompts": [...], "labels": [...]}
      -> {"rewards", "scores", "format_rewards", "acc_rewards"}: one number per query
    GET /health -> {"status": "ok", "scoring": ..., counters}

    \b
    reward = accuracy + FORMAT_WEIGHT x format   (FORMAT_WEIGHT: --format-weight, 0.5)

    \b
    --scoring openrlhf-m (default): OpenRLHF-M's reward server, item for item.
      response: the query after the template's assistant prefix (--prompt-template),
        end tokens removed; format: 1 if it is exactly <think>...</think><answer>...</answer>.
      accuracy: math-verify with the seed's settings on the whole response (\\boxed{} first,
        then $...$ etc. after "answer"), against the gold in $...$: the --dataset answer for
        the request's prompt (the most similar prompt if not exact), else labels[i].
        An unparseable gold scores 1, as in the seed (--strict 1: 0).
    --scoring boxed: the last \\boxed{} (else the last <answer> block) against the gold
      (labels[i], else the --dataset answer for the prompt); format: 1 if the response gives
      exactly one boxed answer or one <answer> block.
    --scoring openrlhf-boxed: upstream OpenRLHF's math reward function, item for item
      (the last \\boxed{} of the response, graded by its rules); reward = accuracy.
    --func FILE: the file's reward_func(queries, prompts, labels), upstream OpenRLHF's
      contract, one item per call in the verifier processes (--item-timeout, --default-reward).

    \b
    Replies add "scores" (the accuracy, or the function's scores); --extra-logs 1 adds
    "extra_logs" (a dict of lists: upstream OpenRLHF logs it; OpenRLHF-M's client cannot take it).

    Stops cleanly on SIGTERM or SIGINT (exit 0). docs/reward-server.md has the full rules.
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
