"""A job that saves a checkpoint once, then trains until stopped; started with podagent's resume
flag (`--load_checkpoint`) it says what it resumed from and succeeds. Its first line is its own
argument list. The checkpoint is `step-1/model.txt` in $PODAGENT_CHECKPOINT_DIR."""

import os
import sys
import time

print("ARGV", sys.argv[1:], flush=True)
step = os.path.join(os.environ["PODAGENT_CHECKPOINT_DIR"], "step-1")
if "--load_checkpoint" in sys.argv:
    print("resumed from", sorted(os.listdir(step)), flush=True)
    sys.exit(0)
os.makedirs(step)
with open(os.path.join(step, "model.txt"), "w") as f:
    f.write("weights")
print("saved", flush=True)
time.sleep(600)
