"""podagent's vocabulary on the wire: the names of the events every podagent records (each a
JSON line in the run's events.jsonl, on screen with PODAGENT_LOG_FORMAT=json, and what `up`
follows in the head's log), and the states the head, a worker and a run without Ray move
through. Each is defined here once; whoever says or reads one uses these names.
"""

from __future__ import annotations

from podagent.choices import Named


class Event(Named):
    """An event's name (its `event` field)."""

    # Any podagent, any run
    ROLE = "role"  # this start: its role, why, the run, the versions
    PREPARED = "prepared"  # this pod's NCCL preset, address and GPUs
    GPU_CHECK = "gpu_check"  # the GPU check's verdict, its failures and figures
    LIMITS = "limits"
    STATE = "state"  # a lifecycle's new state (`state`: a HeadState or WorkerState value)
    EXIT = "exit"  # this start's exit code (and the error that chose it)
    RUN_OVER = "run_over"  # the head: the run is over for good, with its code
    STAYING = "staying"
    STOP_POD = "stop_pod"
    TERMINATE_RUN = "terminate_run"
    TERMINATING = "terminating"
    TEARDOWN_STARTED = "teardown_started"
    TEARDOWN = "teardown"
    TEARDOWN_STEP_FAILED = "teardown_step_failed"
    FINISHED_EARLIER = "finished_earlier"
    RUN_INTERRUPTED_EARLIER = "run_interrupted_earlier"
    EARLIER_ATTEMPTS = "earlier_attempts"
    RESTART = "restart"  # a restart under the restart policy
    RESTARTED = "restarted"
    HANG = "hang"  # no progress for PODAGENT_HANG_TIMEOUT: the stacks dumped, the culprit named
    STOP_REQUESTED = "stop_requested"
    DEADLINE = "deadline"  # PODAGENT_DEADLINE passed: the run ends in order (run/cap.py)
    # The Ray engine's head
    RAY_HEAD = "ray_head"  # a timed step
    DASHBOARD_READY = "dashboard_ready"  # a timed step
    STALE_RAY_STOPPED = "stale_ray_stopped"
    AUTH_OFF = "auth_off"
    LISTEN_ALL = "listen_all"
    PORT_PUBLISHED = "port_published"
    REATTACHED = "reattached"
    WORKERS_JOINED = "workers_joined"  # a timed step: the wait for the workers
    CLUSTER_WHOLE = "cluster_whole"  # a timed step: the wait after a restart
    WORKER_JOINED = "worker_joined"
    WORKER_LOST = "worker_lost"
    WORKERS_COUNTED = "workers_counted"
    REWARD_READY = "reward_ready"  # a timed step
    REWARD_SCORING = "reward_scoring"
    REWARD_DATASET = "reward_dataset"
    REWARD_FAILED = "reward_failed"
    REWARD_RESTART = "reward_restart"
    REWARD_RECOVERED = "reward_recovered"
    JOB_SUBMITTED = "job_submitted"  # a timed step
    JOB_FINISHED = "job_finished"  # a timed step
    JOB_STOPPED = "job_stopped"
    POD_REPLACED = "pod_replaced"  # a detached run's head replaced a worker RunPod lost
    RESUME = "resume"
    CHECK = "check"  # the cluster check's result
    # The Ray engine's worker
    HEAD_FOUND = "head_found"  # a timed step
    JOINED = "joined"  # a timed step
    REJOINING = "rejoining"
    # A run without Ray
    RENDEZVOUS_DONE = "rendezvous_done"
    STEP_STARTED = "step_started"
    DATA_CHECK = "data_check"
    TRAINING_STOPPED = "training_stopped"


class HeadState(Named):
    """PREPARING -> CLEANING -> STARTING_RAY -> STARTING_REWARD -> WAITING_WORKERS
    -> WAITING_REWARD -> SUBMITTING -> RUNNING -> DONE, and RUNNING -> RECOVERING -> SUBMITTING
    when a node of the job is lost (PODAGENT_ON_NODE_LOSS).

    Before it, the start (run/start.py) read the run's ledger: a run that finished earlier is
    not run again (no state is entered); one interrupted mid-job is submitted again.
    The reward server loads while the workers join. Re-attaching (CLEANING finds this pod's Ray
    still running this run's job) skips STARTING_RAY: the reward server is kept if it answers,
    the workers are counted, not awaited, and SUBMITTING finds the job and follows it.
    Any state may raise (an error or a signal) or end on a stop request; teardown then runs
    from `finally`.
    """
    PREPARING = "preparing"
    CLEANING = "cleaning"
    STARTING_RAY = "starting_ray"
    STARTING_REWARD = "starting_reward"
    WAITING_WORKERS = "waiting_workers"
    WAITING_REWARD = "waiting_reward"
    SUBMITTING = "submitting"
    RUNNING = "running"
    RECOVERING = "recovering"
    DONE = "done"


class WorkerState(Named):
    """FINDING_HEAD -> PREPARING -> CLEANING -> JOINING -> WATCHING -> LEFT.

    A head that goes away (while this pod joins, or once joined past the grace) or that closes
    only this start of its run sends the worker back to FINDING_HEAD with its Ray stopped
    (PODAGENT_REJOIN=0: it exits instead). Any state may raise (an error or a signal);
    teardown then runs from `finally`.
    """
    FINDING_HEAD = "finding_head"
    PREPARING = "preparing"
    CLEANING = "cleaning"
    JOINING = "joining"
    WATCHING = "watching"
    LEFT = "left"


class GangPhase(Named):
    """A run without Ray on one pod: RENDEZVOUS -> RUNNING (each step: the data check, then the
    training) -> ENDING -> DONE."""
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    ENDING = "ending"
    DONE = "done"


class Ending(Named):
    """How a run ended (or what would end it), strongest last: the kernel's `Cause`
    (run/policy.py), in a run without Ray's end message and its ENDING state."""
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"  # by `podagent stop`, or by someone else through Ray
    OVERLAP = "overlap"  # the data check found ranks seeing the same samples
    FAILED = "failed"  # the training (the job) failed by itself
    HUNG = "hung"  # no progress for PODAGENT_HANG_TIMEOUT (run/progress.py)
    LOST = "lost"  # a pod was lost, cut off or stopped
    DEADLINE = "deadline"  # PODAGENT_DEADLINE passed (run/cap.py): nothing starts it again


class MemberState(Named):
    """A worker of a run without Ray as its head sees it."""
    JOINED = "joined"  # said hello in the rendezvous
    RUNNING = "running"  # given its rank and go
    DONE = "done"  # its step ended and it said so
    LOST = "lost"  # gone without leaving (dead, cut off, silent past the grace)
    OUT = "out"  # left once told the run is over
