"""Exit codes: the one table of what each of podagent's errors exits with, what a pod then
does on RunPod, and which codes a new start of a pod may mend (RESTARTABLE: the run policy's
and the after-run settling's). The README's table is printed from here (`table`); the command
line, the run's start (run/start.py) and `up` each read it, none keeps a mapping of its own.
"""

from __future__ import annotations

import signal

from podagent import errors
from podagent.run.ledger import SUCCEEDED

# Exit codes: documented in the README's table. Signals give 128 + the signal number.
EXIT_OK = 0
EXIT_CODES: tuple[tuple[type[errors.PodagentError], int, str], ...] = (
    (errors.ConfigError, 2, "bad input: a setting is invalid (the line names it)"),
    (errors.RoleConflict, 2, "bad input: role variables contradict each other"),
    (errors.MissingDependency, 2, "bad input: an optional part this run needs is not installed "
                                  "(the line names the extra, or torch)"),
    (errors.RayFeatureMissing, 2, "bad input: a setting needs a newer Ray than this image has "
                                  "(the line names both)"),
    (errors.ForeignRay, 2, "bad input: a Ray that podagent did not start runs on this pod "
                           "(the line names it; podagent neither starts a second one nor "
                           "stops it)"),
    (errors.RayVersionMismatch, 2, "worker: this pod's Ray version differs from the head's "
                                   "(every pod must run the same image)"),
    (errors.JobFailed, 3, "the job failed (without Ray: the training, on any pod)"),
    (errors.JobStopped, 4, "the job was stopped by someone else"),
    (errors.WorkersTimeout, 5, "head: fewer workers joined than expected in time (in a run "
                               "without Ray, the workers that came exit so too)"),
    (errors.HeadUnreachable, 6, "worker: the head could not be found or joined in time"),
    (errors.HeadLost, 7, "worker: the head went away for longer than the grace period"),
    (errors.RayUnhealthy, 8, "Ray failed to start or became unhealthy"),
    (errors.PortInUse, 9, "a port podagent needs is held by another program"),
    (errors.RayDied, 10, "this pod's own Ray stopped while podagent watched it"),
    (errors.RewardServerFailed, 11, "head: the reward server exited at start, or died more "
                                    "often than PODAGENT_REWARD_RESTARTS allows"),
    (errors.RewardServerTimeout, 12, "head: the reward server never answered a real request "
                                     "within PODAGENT_REWARD_TIMEOUT"),
    (errors.AuthRefused, 13, "worker: the head refused this pod's cluster token"),
    (errors.JobSubmitFailed, 14, "head: Ray's Jobs API refused the job or did not accept it "
                                 "in time"),
    (errors.StopTimeout, 15, "`podagent stop`: the cluster was still up when --timeout ran out"),
    (errors.RestartsExhausted, 16, "head: the run was restarted PODAGENT_RESTARTS times after "
                                   "lost nodes and lost another (logs and checkpoints are kept)"),
    (errors.LedgerError, 17, "head: the run's ledger on the volume could not be written "
                             "(full or read-only), so no job was submitted"),
    (errors.RunPodAuthError, 18, "`podagent up/down/ls`: RunPod refused the API key (401) or "
                                 "what it may do (403)"),
    (errors.NoCapacity, 19, "`podagent up`: RunPod could not place the pods (no capacity for "
                            "the GPU type in the data centers asked for; the line names both)"),
    (errors.RunPodApiError, 20, "`podagent up/down/ls`: RunPod's API refused a request or did "
                                "not answer in time (the line names the request)"),
    (errors.PodsNotReady, 21, "`podagent up`: a pod did not start (RUNNING) in time or failed; "
                              "what was created has been terminated"),
    (errors.PodGone, 24, "`podagent up`: a pod of the run was stopped, failed or was "
                         "terminated at RunPod while the run went on, past `--replacements` "
                         "(the line names it); every pod has been terminated"),
    (errors.PeerLost, 22, "`podagent torchrun/accelerate`: another pod of the run was lost, "
                          "cut off or stopped (the line names it); this pod's training was "
                          "stopped"),
    (errors.DataOverlap, 23, "`podagent torchrun/accelerate --data-check`: ranks see the same "
                             "samples (the line has the numbers)"),
    (errors.RunHung, 25, "the run made no progress for PODAGENT_HANG_TIMEOUT seconds: every "
                         "rank's stack was dumped (the line names the likely culprit and where "
                         "the stacks are), the run stopped on every pod, and restarts were off "
                         "or used up"),
    (errors.PodsLeftBilling, 26, "`podagent up` (whatever ended the run) or `podagent down`: the "
                                 "run's pods could not all be terminated (RunPod refused or did "
                                 "not answer): they may still bill; the line names them, and "
                                 "`podagent down RUN` (again) terminates them"),
    (errors.DeadlineReached, 27, "PODAGENT_DEADLINE (`up --max-duration/--max-cost`) came: "
                                 "the job had PODAGENT_STOP_TIMEOUT to checkpoint, every pod "
                                 "ended"),
    (errors.GpuCheckFailed, 28, "this pod's GPUs failed their check before the job "
                                "(PODAGENT_GPU_CHECK; the line names each fault); `podagent "
                                "up`: a pod's did, past `--replacements`"),
)
EXIT_INTERNAL = 70  # a bug in podagent: the traceback goes to the pod's log

# What a pod's podagent does after each code on RunPod (run/after_run.py), where RunPod starts
# a container again whenever its process exits. Codes a new start may mend exit, and RunPod
# starts the pod's podagent again; every other code of a pod stops the pod (PODAGENT_AFTER_RUN).
RESTARTABLE = frozenset({5, 6, 7, 8, 9, 10, 14, 22, EXIT_INTERNAL})
NOT_A_POD = frozenset({15, 18, 19, 20, 21, 24, 26})  # `podagent stop`, and the laptop's up/down/ls
_ON_RUNPOD = {
    "stops": "stops itself (PODAGENT_AFTER_RUN)",
    "restarts": "exits; RunPod starts it again (a crash loop, 5 such ends in a row, or no "
                "volume, stops it)",
    "not a pod": "—",
}


def restartable(code: int) -> bool:
    """Whether a new start of a pod's podagent may mend this exit (RunPod then starts it)."""
    return code in RESTARTABLE


def on_runpod(code: int) -> str:
    kind = "not a pod" if code in NOT_A_POD else "restarts" if restartable(code) else "stops"
    return _ON_RUNPOD[kind]


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, errors.Interrupted):
        return 128 + exc.signum
    return _code_of_class(type(exc))


def code_of(error: type[errors.PodagentError]) -> int:
    """The code of an error class, from the table."""
    return _code_of_class(error)


def _code_of_class(error: type[BaseException]) -> int:
    """The first class of EXIT_CODES the error is (a subclass of); else a bug: 70."""
    for cls, code, _ in EXIT_CODES:
        if issubclass(error, cls):
            return code
    return EXIT_INTERNAL


def table() -> str:
    rows = ["| code | meaning | on RunPod, the pod then |", "|---|---|---|",
            "| 0 | success: the job succeeded / the worker left an orderly cluster | stops "
            "itself: the run is over (PODAGENT_AFTER_RUN) |"]
    rows += [f"| {code} | {meaning} | {on_runpod(code)} |" for _, code, meaning in EXIT_CODES]
    rows += [f"| {EXIT_INTERNAL} | internal error in podagent (traceback in the pod's log) | "
             f"{on_runpod(EXIT_INTERNAL)} |",
             "| 130 / 143 | stopped by SIGINT / SIGTERM after a clean teardown | stopped (RunPod "
             "stopped it, or a person) |"]
    return "\n".join(rows)


# How each way a start of the run can end (the lifecycle's outcome: the error's class name, or
# one of these) maps onto the exit code; a restarted head repeats a finished run's code.
OK_OUTCOMES = (SUCCEEDED, "left", "StopRequested")


def code_for_outcome(outcome: str) -> int | None:
    """None for a signal (its number is not in the outcome: 130 or 143)."""
    if outcome in OK_OUTCOMES:
        return EXIT_OK
    error = getattr(errors, outcome, None)
    if error is errors.Interrupted:
        return None
    if isinstance(error, type) and issubclass(error, errors.PodagentError):
        return _code_of_class(error)
    return EXIT_INTERNAL


def finished_code(outcome: str) -> int:
    """A head that found its run finished earlier exits as that run did: the code follows from
    the recorded outcome, so a head killed before it wrote its code is still read right."""
    code = code_for_outcome(outcome)  # a finished run never ended by a signal
    return EXIT_INTERNAL if code is None else code


def meaning(code: int) -> str:
    """An exit code in words, from the table (the run's code, as the head gave it)."""
    if code == EXIT_INTERNAL:
        return "internal error in podagent"
    if code > 128:
        try:
            return f"stopped by {signal.Signals(code - 128).name}"
        except ValueError:  # no such signal: a code a job chose
            return f"exit {code}"
    return next((meaning for _, c, meaning in EXIT_CODES if c == code), f"exit {code}")
