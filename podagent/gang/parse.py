"""The launchers' own argument parsers, run in a short-lived child process: torchrun's and
accelerate's parsers import torch (about 200 MiB), which the podagent that stays for the whole
run never needs.

`python -m podagent.gang.parse torchrun|accelerate ARGS...` prints one JSON line: the user's
arguments split into the launcher's options and the script, or {"error": line} for arguments
the launcher refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from podagent.config.policy import child_environ, is_secret
from podagent.errors import ConfigError, InputError

PARSE_TIMEOUT = 120.0  # seconds: importing torch on a busy pod is slow, never this slow
NO_SCRIPT = "podagent-no-script"  # stands in for a script torchrun's parser insists on


def split(kind: str, args: Sequence[str]) -> dict[str, Any]:
    """The child's answer; InputError for arguments the launcher refuses. Arguments that
    start with the script (or "--") hold no launcher option: no child is needed."""
    if not args or args[0] == "--" or not args[0].startswith("-"):
        script = list(args[1:] if args[:1] == ["--"] else args)
        return {"options": [], "script": script, "nproc": None, "config_file": None,
                "given": {}, "typed": [], "flags": []}
    done = subprocess.run([sys.executable, "-m", "podagent.gang.parse", kind, *args],
                          capture_output=True, text=True, timeout=PARSE_TIMEOUT,
                          env=child_environ(os.environ, is_secret),  # it needs none
                          stdin=subprocess.DEVNULL)
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"parsing {kind}'s arguments failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}") from None
    if "error" in answer:
        raise InputError(str(answer["error"]))
    return answer


def _torchrun(args: list[str]) -> dict[str, Any]:
    import torch.distributed.run as torch_run

    try:  # a stand-in script after them: torchrun's parser wants one, the user's may not
        parsed, _ = torch_run.get_args_parser().parse_known_args([*args, NO_SCRIPT])
    except SystemExit:
        raise InputError(f"podagent torchrun: torchrun refuses these options: "
                         f"{' '.join(args)}") from None
    if parsed.training_script == NO_SCRIPT:
        start = len(args)
    else:  # the script and its arguments are the tail, the stand-in last among them
        start = len(args) - len(parsed.training_script_args[:-1]) - 1
    options = [a for a in args[:start] if a != "--"]
    typed = any(a.split("=")[0] in ("--nproc-per-node", "--nproc_per_node") for a in options)
    nproc = str(parsed.nproc_per_node) if typed else ""
    return {"options": options, "script": args[start:],
            "nproc": int(nproc) if nproc.isdigit() else None}


def _accelerate(args: list[str]) -> dict[str, Any]:
    from podagent.gang import accelerate

    split_args = accelerate.split(args)
    return {"options": list(split_args.options), "script": list(split_args.script),
            "config_file": split_args.config_file, "given": dict(split_args.given),
            "typed": [[o.dest, list(o.tokens), o.value] for o in split_args.typed],
            "flags": sorted(split_args.flags)}


def main(argv: Sequence[str]) -> int:
    kind, *args = argv
    try:
        answer = {"torchrun": _torchrun, "accelerate": _accelerate}[kind](list(args))
    except ConfigError as exc:
        answer = {"error": str(exc)}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
