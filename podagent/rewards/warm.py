"""Imported by the verifier pool's forkserver, and only there: math-verify is imported and run
once in that process (for both scoring profiles), and every worker forked from it
(replacements after a timeout too) starts warm instead of paying about a second of sympy's
first-use imports. A reward rule served by `func` (a user's file, or openrlhf-boxed) is loaded
here too when the pool names it."""

import contextlib
import os

from podagent.rewards import openrlhf_m_verify, verify
from podagent.rewards.pool import PRELOAD_ENV

verify.worker_warm()
openrlhf_m_verify.worker_warm()

if os.environ.get(PRELOAD_ENV):
    from podagent.rewards import func

    # A failure here is not the place to report: each worker loads it again, and the server
    # says why it cannot.
    with contextlib.suppress(Exception):
        func.worker_load(os.environ[PRELOAD_ENV])
