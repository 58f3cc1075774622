"""Waiting for workers: the one rule for when fewer than expected came in time."""

from __future__ import annotations

from podagent.errors import WorkersTimeout
from podagent.report import Reporter


def accept_shortfall(reporter: Reporter, joined: list[str], expected: int,
                     minimum: int | None, timeout: float, missing: str | None = None) -> None:
    """`joined` (their names) came of `expected` workers within `timeout`: raises
    WorkersTimeout unless PODAGENT_MIN_WORKERS says that many will do, else warns and the run
    goes on with them. `missing`: the engine's own account of who is missing, for the error."""
    if len(joined) >= expected:
        return
    who = ", ".join(joined) or "none"
    if minimum is None or len(joined) < minimum:
        raise WorkersTimeout(missing or f"only {len(joined)} of {expected} workers joined "
                                        f"within {timeout:g} s; joined: {who}")
    reporter.warn(f"{len(joined)} of {expected} workers joined ({who}); going on because "
                  f"PODAGENT_MIN_WORKERS={minimum}")
