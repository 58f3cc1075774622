"""OpenRLHF's PPO entry point as the tests see it (0.10.2 on: dotted options, no aliases, an
unknown option refused as its argparse does): `--ckpt.path DIR` and the switch
`--ckpt.load_enable`, over the tests' real small training (tests/jobs/tiny_train.py, run as
this process's main module so Ray ships its classes by value).

Each start appends its own argv to DIR/.argv.jsonl (hidden: no checkpoint), so a test sees
what the trainer itself received, not what podagent said it would give it.

    cd tests/jobs/fake_openrlhf && python -m openrlhf.cli.train_ppo_ray --ckpt.path DIR
        [--ckpt.load_enable] [--steps N --every N --step-time S]
"""

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[3] / "tiny_train.py"

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--ckpt.path", required=True)
parser.add_argument("--ckpt.load_enable", action="store_true", default=False)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--every", type=int, default=20)
parser.add_argument("--step-time", type=float, default=0.05)
args = vars(parser.parse_args())

checkpoints = Path(args["ckpt.path"])
checkpoints.mkdir(parents=True, exist_ok=True)
with open(checkpoints / ".argv.jsonl", "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:],
                        "attempt": int(os.environ.get("PODAGENT_ATTEMPT", "1"))}) + "\n")
os.environ["PODAGENT_CHECKPOINT_DIR"] = str(checkpoints)
sys.argv = [str(TRAIN), "--steps", str(args["steps"]), "--every", str(args["every"]),
            "--step-time", str(args["step_time"]),
            *(["--load_checkpoint"] if args["ckpt.load_enable"] else [])]
runpy.run_path(str(TRAIN), run_name="__main__")
