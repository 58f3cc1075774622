"""Imported by the verifier pool's forkserver, and only there: math-verify is imported and run
once in that process (for both scoring profiles), and every worker forked from it
(replacements after a timeout too) starts warm instead of paying about a second of sympy's
first-use imports."""

from podagent.rewards import openrlhf_m_verify, verify

verify.worker_warm()
openrlhf_m_verify.worker_warm()
