"""One error hierarchy. Each error's exit code is in the one table, run/exits.py."""

from __future__ import annotations


class PodagentError(Exception):
    """Base class: the message is one line a user can act on."""


class ConfigError(PodagentError):
    """A setting is invalid; raised before podagent touches anything."""

    def __init__(self, name: str, value: object, rule: str):
        self.name, self.value, self.rule = name, value, rule
        shown = value if value == "<redacted>" else repr(value)
        super().__init__(f"{name}={shown} {rule}")


class InputError(ConfigError):
    """Bad input that is not one setting's value (two options that exclude each other, a
    missing key): the message says it all."""

    def __init__(self, message: str):
        self.name, self.value, self.rule = "", None, message
        PodagentError.__init__(self, message)


class MissingDependency(PodagentError):
    """An optional part of podagent (an extra, or the image's torch) is not installed; raised
    before podagent touches anything. The message names what to install."""


class RayFeatureMissing(PodagentError):
    """A setting asks for something this image's Ray does not have (e.g. a cluster token on a
    Ray older than 2.52); raised before podagent touches anything."""


class RayVersionMismatch(PodagentError):
    """This pod's Ray is not the head's: Ray needs one version on every node."""


class RoleConflict(PodagentError):
    """Two facts about this pod's role disagree (two heads are worse than none)."""


class ForeignRay(PodagentError):
    """A Ray that podagent did not start runs on this pod (e.g. the one a RunPod cluster of type
    RAY brings): podagent neither starts a second Ray beside it nor stops it."""


class PortInUse(PodagentError):
    def __init__(self, port: int, address: str, holder: str | None):
        self.port = port
        who = f" by {holder}" if holder else " (holder not visible from here)"
        super().__init__(f"port {port} on {address} is already in use{who}")


class RayUnhealthy(PodagentError):
    """This pod's Ray could not be started or stopped answering: one exit code for both."""


class RayStartError(RayUnhealthy):
    """`ray start` failed or Ray did not become healthy."""


class GcsLost(RayUnhealthy):
    """This pod's Ray GCS answered once and then stopped answering."""


class RayDied(PodagentError):
    """This pod's own Ray stopped while podagent was watching it."""


class DashboardSilent(RayDied):
    """This pod's Ray dashboard (the Jobs API) exited or stopped answering while its GCS
    lives: Ray does not restart it, and the job can no longer be followed."""


class WorkersTimeout(PodagentError):
    """The head waited for workers and not enough joined."""


class HeadUnreachable(PodagentError):
    """A worker could not find or reach the head within its timeout."""


class HeadLost(PodagentError):
    """A joined worker lost the head for longer than the grace period."""


class JobFailed(PodagentError):
    pass


class PeerLost(PodagentError):
    """A run without Ray: another pod of it was lost (its podagent gone or silent past
    PODAGENT_PEER_GRACE, or stopped) or its training failed; this pod's training was stopped."""

    def __init__(self, message: str, pod: str = ""):
        self.pod = pod
        super().__init__(message)


class DataOverlap(PodagentError):
    """The data check of a run without Ray: ranks see the same samples (or did not form one
    run); the message has the numbers."""


class RestartsExhausted(PodagentError):
    """Nodes were lost (or the job failed) more often than PODAGENT_RESTARTS allows."""


class JobStopped(PodagentError):
    pass


class RunHung(PodagentError):
    """The run made no progress for PODAGENT_HANG_TIMEOUT seconds (run/progress.py): its stacks
    were dumped on every pod and it was stopped, and it is not started again (restarts off
    or used up). The message names the likely culprit and where the stacks are."""


class DeadlineReached(PodagentError):
    """The run reached PODAGENT_DEADLINE (`podagent up --max-duration/--max-cost` sets it):
    its job was stopped with a grace to checkpoint, every pod ended, and it is not started
    again."""


class GpuCheckFailed(PodagentError):
    """This pod's GPUs failed the check before the job (run/gpu_check.py: missing, of
    another type, with memory errors, slow, or not reducing together); the message names
    each failure. A new start on the same GPUs would fail again: the pod stops, and `podagent
    up` replaces it."""


class LedgerError(PodagentError):
    """The run's ledger on the volume could not be written (full, read-only, gone): the head
    does not submit a job it could not record (a restarted head would not know of it)."""


class JobSubmitFailed(PodagentError):
    """Ray's Jobs API refused the job, or did not accept it in time."""


class RewardServerFailed(PodagentError):
    """The reward server exited while starting, or died more often than it may be restarted."""


class RewardServerTimeout(PodagentError):
    """The reward server never answered a real request within its timeout."""


class AuthRefused(PodagentError):
    """The head's Ray refused this pod's cluster token."""


class StopTimeout(PodagentError):
    """`podagent stop`: the cluster did not go down in time after the stop request."""


class Interrupted(PodagentError):
    """A signal asked podagent to stop; teardown has run."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class RunPodApiError(PodagentError):
    """RunPod's API did not do what podagent asked (e.g. stop this pod). The message names the
    request's path, the status and RunPod's reason; never the API key. `answered`: RunPod
    answered, and refused (a 4xx): what was asked did not happen. Otherwise (no answer, 5xx to
    the end, a create's 2xx without its pod) it may have."""

    answered = False


class RunPodAuthError(RunPodApiError):
    """RunPod refused the API key (401) or what it allows (403)."""


class RunPodConflict(RunPodApiError):
    """RunPod answered 409: the action is not valid for the pod's status (its `actions` field
    lists the valid ones)."""


class RunPodNonsense(RunPodApiError):
    """RunPod answered 2xx with a body that is not what its document gives (no pod in a
    create's answer, a list that is not one): never read on as if it were."""


class CreateUnsettled(RunPodApiError):
    """The look for a create's pod, after a failure that may have created it, failed: whether
    the create was carried out is not known (never a refusal of the create itself)."""


class NoCapacity(RunPodApiError):
    """RunPod could not place what was asked (400 on a create: no capacity for the GPU type in
    the data centers asked for, or a rule of the request; RunPod gives only a detail)."""


class PodGone(PodagentError):
    """`podagent up`: a pod of the run that had been RUNNING was stopped (EXITED), failed
    (ERROR) or terminated at RunPod, not by podagent, while the run went on. Every pod has
    been terminated."""


class PodsNotReady(PodagentError):
    """`podagent up`: a pod did not reach RUNNING, or the run did not start, in time; or a
    pod went into ERROR. Whatever was created has been terminated."""


class PodsLeftBilling(PodagentError):
    """`podagent up`'s clean-up (whatever ended the run) or `podagent down` could not terminate
    every pod of the run (RunPod refused, did not answer past the retries, or answered
    nonsense): they may still bill. The message names them and `podagent down RUN`, which
    finishes the job."""


class NoHeadLocation(ConfigError, HeadUnreachable):
    """A worker was given no way to find the head (none of the settings that name it is set).
    Bad input, so a ConfigError (exit 2); also a HeadUnreachable, as HeadFinder.locate
    raised that for it before."""
