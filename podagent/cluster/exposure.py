"""Who can reach the head's dashboard (and so run code on it), its GCS and its reward server,
said loudly before Ray starts: an open Jobs API is remote code execution (CVE-2023-48022)."""

from __future__ import annotations

from podagent.config import Settings
from podagent.ray_access import ray_compat
from podagent.report import Reporter
from podagent.wire import Event

# The head's services: the setting of its port, what it is, and whether a cluster token
# guards it (the reward server asks for nothing, ever).
SERVICES = (("ray_port", "Ray's GCS", True),
            ("dashboard_port", "the Ray dashboard and Jobs API", True),
            ("reward_port", "the reward server", False))
# RunPod sets this for each TCP port of the pod's template: the public port it is published on.
PUBLISHED_TCP = "RUNPOD_TCP_PORT_{port}"


def warn(settings: Settings, listen: str, reporter: Reporter) -> None:
    _published(settings, reporter)
    dashboard = f"{listen}:{settings.dashboard_port}"
    if settings.listen == "all":
        reward = ("" if settings.reward == "none"
                  else f" and the reward server on port {settings.reward_port}")
        if settings.auth_token:
            reporter.say(f"PODAGENT_LISTEN=all: the dashboard{reward} listen on every "
                         f"interface ({dashboard}); the Jobs API asks for the token, "
                         f"the reward server asks for nothing")
        else:
            reporter.warn(
                f"PODAGENT_LISTEN=all WITHOUT A CLUSTER TOKEN: the Ray dashboard{reward} "
                f"listen on EVERY interface of this pod ({dashboard}), public ones too: "
                f"anyone who reaches port {settings.dashboard_port} can run any code here. "
                f"Set PODAGENT_TOKEN on every pod, or use PODAGENT_LISTEN=private")
        reporter.event(Event.LISTEN_ALL, dashboard=dashboard, token=bool(settings.auth_token))
    if not settings.auth_token and not listen.startswith("127."):
        if settings.listen != "all":  # that warning said it already, louder
            reporter.warn(
                f"NO CLUSTER TOKEN: the Ray dashboard and Jobs API on {dashboard} will run "
                f"jobs for anyone who can reach them; {token_advice()}")
        reporter.event(Event.AUTH_OFF, dashboard=dashboard)


def token_advice() -> str:
    ray = ray_compat.installed()
    feature = ray_compat.FEATURES["token_auth"]
    if ray and not ray.has(feature.name):
        return (f"this image's {ray} has no cluster tokens (Ray {feature.since} or newer has "
                f"them): keep the pods' network private")
    return "set PODAGENT_TOKEN on every pod (`podagent token` makes one)"


def _published(settings: Settings, reporter: Reporter) -> None:
    """A template that lists one of the head's ports publishes it on the pod's public address
    (the GCS listens on every interface whatever PODAGENT_LISTEN says)."""
    for attr, what, token_guards in SERVICES:
        if attr == "reward_port" and settings.reward == "none":
            continue
        port = getattr(settings, attr)
        public = settings.environ.get(PUBLISHED_TCP.format(port=port), "").strip()
        if not public:
            continue
        if token_guards and settings.auth_token:
            reporter.say(f"port {port} ({what}) is published to the internet "
                         f"({PUBLISHED_TCP.format(port=port)}={public}); the cluster token "
                         f"guards it")
        else:
            reporter.warn(f"PORT {port} ({what.upper()}) IS PUBLISHED TO THE INTERNET "
                          f"({PUBLISHED_TCP.format(port=port)}={public}) AND ASKS FOR NO "
                          f"AUTHENTICATION: remove {port} from the pod template's ports (the "
                          f"pods reach each other over the private network)")
        reporter.event(Event.PORT_PUBLISHED, port=port, service=what, public=public,
                       token=bool(token_guards and settings.auth_token))
