"""`podagent up`'s options, each declared once: its flag, the spec's field it fills, its kind,
default and help. The CLI makes its command line from them (cli.py), `spec.build()` names the
flag in each of its errors by the field, and docs/up.md's table is made from them
(`python -m podagent.launch.options`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from podagent.choices import LAUNCHERS, RAY_LAUNCHER


@dataclass(frozen=True)
class UpOption:
    """One option: `flags` as typed (the last is its name in errors), `attr` the keyword of
    `spec.build()` it fills; `kind` is str, int, float, bool (a flag) or a tuple of the
    choices."""
    attr: str
    flags: tuple[str, ...]
    kind: type | tuple[str, ...]
    default: Any
    help: str
    metavar: str | None = None
    multiple: bool = False

    @property
    def flag(self) -> str:
        return self.flags[-1]


UP_OPTIONS: tuple[UpOption, ...] = (
    UpOption("run", ("--name",), str, None, metavar="RUN",
             help="The run's name (its pods are podagent-RUN-head, -w1, ...); again with the "
                  "same name re-attaches. Default: up-YYYYmmdd-HHMMSS."),
    UpOption("image", ("--image",), str, None,
             help="The container image of every pod (your trainer's image with podagent)."),
    UpOption("template", ("--template",), str, None, metavar="TEMPLATE_ID",
             help="A RunPod pod template instead of --image."),
    UpOption("gpu_type", ("--gpu",), str, "", metavar="TYPE",
             help="RunPod's GPU type id, e.g. 'NVIDIA H100 80GB HBM3' (--list-gpus)."),
    UpOption("gpus_per_pod", ("--gpus",), int, 1, help="GPUs per pod."),
    UpOption("pods", ("--pods",), int, 2, help="Pods in all: the head and pods-1 workers."),
    UpOption("cluster", ("--cluster",), bool, False,
             help="One RunPod Instant Cluster (fast interconnect, one data center) instead of "
                  "pods on Global Networking."),
    UpOption("cloud", ("--cloud",), str, "SECURE", help="SECURE or COMMUNITY."),
    UpOption("data_centers", ("--data-center",), str, (), metavar="ID", multiple=True,
             help="A data center to place the pods in (repeat for several; default any)."),
    UpOption("volume_gb", ("--volume",), int, None, metavar="GB",
             help="A volume of this size on each pod at /workspace (logs, checkpoints)."),
    UpOption("network_volume", ("--network-volume",), str, None, metavar="ID",
             help="A network volume mounted at /workspace instead."),
    UpOption("shared_volume_gb", ("--shared-volume",), int, None, metavar="GB",
             help="The size of the network volume `up` creates for a run of several pods "
                  "(default: from the model size the job names, else 100): mounted at "
                  "/workspace on every pod, it keeps the checkpoints and the model after the "
                  "run (`podagent down RUN --volume` deletes it)."),
    UpOption("no_shared_volume", ("--no-shared-volume",), bool, False,
             help="No network volume: the checkpoints and the model die with the pods."),
    UpOption("disk_gb", ("--disk",), int, None, metavar="GB", help="Container disk per pod."),
    UpOption("env", ("-e", "--env"), str, (), metavar="NAME=VALUE", multiple=True,
             help="A variable for every pod (repeat). Secrets only with --secret."),
    UpOption("secrets", ("--secret",), str, (), metavar="NAME=SECRET", multiple=True,
             help="Variable NAME from the RunPod secret SECRET (RunPod puts the value in)."),
    UpOption("launcher", ("--launcher",), LAUNCHERS, RAY_LAUNCHER, metavar="LAUNCHER",
             help="What runs the job: ray (a Ray cluster), or torchrun / accelerate on every pod "
                  "without Ray (the job after -- is then the launcher's [OPTIONS] [--] SCRIPT "
                  "ARGS)."),
    UpOption("keep", ("--keep",), bool, False,
             help="Leave the pods up after the run (they bill)."),
    UpOption("detach", ("--detach",), bool, False,
             help="Leave once every pod runs: the run goes on, each pod stops itself when it "
                  "is over (GPU billing ends); `podagent up --name RUN` follows it again."),
    UpOption("registry_auth", ("--registry-auth",), str, None, metavar="ID|NAME",
             help="The RunPod registry credential (its id or name) that pulls a private "
                  "--image (not with --cluster: RunPod takes none there)."),
    UpOption("max_duration", ("--max-duration",), str, None, metavar="DURATION",
             help="End the run this long after its creation (90s, 30m, 12h, 2d): the job gets "
                  "SIGTERM and PODAGENT_STOP_TIMEOUT to checkpoint, then every pod ends "
                  "(exit 27). The pods hold it too (PODAGENT_DEADLINE), detached or not."),
    UpOption("max_cost", ("--max-cost",), float, None, metavar="USD",
             help="End the run once it may have cost this much at RunPod's list price for its "
                  "pods (a duration, as --max-duration; the nearer of the two holds)."),
    UpOption("replacements", ("--replacements",), int, None, metavar="N",
             help="Pods RunPod stops, fails or terminates mid-run that `up` replaces (default "
                  "3): a worker by a new pod of the same spec, the head by the whole run "
                  "created again; the job resumes from its checkpoint. Then a lost pod ends "
                  "the run (exit 24); 0: the first does. Not with --cluster; with --detach "
                  "(on Ray) the head replaces lost workers, given the account key."),
    UpOption("timeout", ("--timeout",), float, 900.0, metavar="SECONDS",
             help="Every pod must be RUNNING within this."),
    UpOption("api_timeout", ("--api-timeout",), float, 60.0, metavar="SECONDS",
             help="How long one RunPod API call may take, its retries (429, 5xx, no "
                  "connection) included."),
)
UP_OPTION = {option.attr: option for option in UP_OPTIONS}


def flag(attr: str) -> str:
    """The flag that sets spec field `attr` (what an error about its value names)."""
    return UP_OPTION[attr].flag


def default(attr: str) -> Any:
    return UP_OPTION[attr].default


def markdown_table() -> str:
    """The options as the docs list them."""
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for option in UP_OPTIONS:
        typed = " ".join(option.flags) + ("" if option.kind is bool else
                                          f" {option.metavar or option.flag.lstrip('-').upper()}")
        shown = "" if option.default in (None, (), False, "") else f"`{option.default}`"
        rows.append(f"| `{typed}` | {shown} | {option.help.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":  # regenerates docs/up.md's table: python -m podagent.launch.options
    print(markdown_table())
