"""math-verify across the supported releases (0.5.2, what OpenRLHF-M's reward server runs, to
0.9.x): the differences the reward server depends on, found by looking at the installed one.

* Timeouts. In 0.9, `parse(..., parsing_timeout=None)` and `verify(..., timeout_seconds=None)`
  turn math-verify's signal-based timeouts off. 0.5.x cannot: `None` reaches `signal.alarm`,
  which raises, and math-verify reports every expression as unparseable. There the alarm is
  set past the longest item time limit (`ALARM_SECONDS`), so the pool's kill is still what ends
  a slow item, as on 0.9. Which behaviour a release has is read from the release itself.
* `verify(..., allow_set_relation_comp=...)` (`x \\le 2` against `(-\\infty, 2]`) does not exist in
  0.5.x; the boxed profile asks for it where it exists (docs/reward-server.md lists what differs).
* What one match's normalized LaTeX is parsed by: `parse_latex_cached` in 0.9 (latex2sympy,
  then the last equation alone if that raises), `parse_latex_with_timeout` in 0.5 (latex2sympy
  under a timeout). `latex_parser` gives the installed release's own.

Imported only where math-verify is installed (the verifier workers, the tests).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib import metadata
from typing import Any

import math_verify
from math_verify import utils as _utils

# Past the largest --item-timeout (600 s): on 0.5.x the pool's kill always comes first.
ALARM_SECONDS = 601


def _release() -> str:
    try:
        return metadata.version("math-verify")
    except metadata.PackageNotFoundError:  # run from a source tree
        return getattr(math_verify, "__version__", "unknown")


def _probe() -> object:
    return None


VERSION = _release()
# A decorator that returns the function itself is math-verify's "no timeout" (0.9 has it).
TIMEOUTS_CAN_BE_OFF = _utils.timeout(None)(_probe) is _probe
SET_RELATION_COMPARISON = "allow_set_relation_comp" in inspect.signature(
    math_verify.verify).parameters


def parse_no_timeout() -> dict[str, Any]:
    """Keyword arguments for `parse` that leave timing out to the caller."""
    return {"parsing_timeout": None if TIMEOUTS_CAN_BE_OFF else ALARM_SECONDS}


def verify_no_timeout(set_relation: bool = False) -> dict[str, Any]:
    """Keyword arguments for `verify`: no timeout of its own; set-relation comparison if asked
    and this release has it."""
    kwargs: dict[str, Any] = {
        "timeout_seconds": None if TIMEOUTS_CAN_BE_OFF else ALARM_SECONDS}
    if set_relation and SET_RELATION_COMPARISON:
        kwargs["allow_set_relation_comp"] = True
    return kwargs


def latex_parser() -> Callable[[str], Any] | None:
    """The installed release's own parse of one match's normalized LaTeX (its value, None, or
    what it raised), without its timeout; None where the release has neither function."""
    from math_verify import parser

    cached = getattr(parser, "parse_latex_cached", None)
    if cached is not None:
        return cached
    timed = getattr(parser, "parse_latex_with_timeout", None)
    if timed is None:
        return None
    return lambda latex: timed(latex, ALARM_SECONDS)
