# podagent on a trainer image. The same image runs on every pod, head and workers alike:
# podagent decides each pod's role at start (see README.md).
#
#   docker build -t <registry>/podagent:0.1.0 .
#   docker build --build-arg BASE_IMAGE=<your trainer's image> -t ... .
#
# BASE_IMAGE is meant to be the image your trainer already runs in (OpenRLHF, verl, ...): it
# brings CUDA, Python, torch and its own Ray, which every node and the job must share. The
# install step below keeps every package the base already has at its version, so podagent
# never changes the trainer's Ray, torch, numpy or math-verify: pip only adds what is missing,
# or the build fails and says which requirement conflicts. A base without Ray gets the newest
# Ray podagent is tested with.
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# tini runs as PID 1: it forwards the runtime's SIGTERM to podagent and reaps orphans.
# Not version-pinned: the version differs between the distributions BASE_IMAGE may be built on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/podagent/src
COPY pyproject.toml README.md ./
COPY env ./env
COPY podagent ./podagent
# Every package of the base is a constraint (name==version); the extras are what a RunPod user
# needs: the built-in reward server and W&B logging of the bring-up.
RUN python -m pip list --format=freeze --exclude-editable > /tmp/base-packages.txt \
    && { grep -qi '^ray==' /tmp/base-packages.txt || echo 'ray==2.60.0' >> /tmp/base-packages.txt; } \
    && python -m pip install --no-cache-dir --constraint /tmp/base-packages.txt '.[reward,wandb]' \
    && rm /tmp/base-packages.txt \
    && podagent --version

COPY --chmod=0755 entrypoints/entrypoint.sh /opt/podagent/entrypoint.sh

# RunPod mounts the pod's volume at /workspace: logs and checkpoints outlive the pod there.
# Secrets (PODAGENT_TOKEN, WANDB_API_KEY) never belong here: set them as RunPod secrets.
ENV PODAGENT_LOG_DIR=/workspace/podagent/logs \
    PODAGENT_CHECKPOINT_DIR=/workspace/checkpoints \
    PYTHONUNBUFFERED=1
WORKDIR /workspace

# No EXPOSE: the GCS (6379), the dashboard and Jobs API (8265) and the reward server (5000)
# are for the cluster's private network; `docker run -P` would publish exposed ports, and the
# Jobs API runs any code it is sent.

# Bring-up can take minutes (the head waits for its workers, a model-backed reward server loads):
# failures during the start period do not count.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 \
    CMD ["podagent", "status", "--local"]

# No -g: tini passes the signal to podagent alone; podagent stops its children itself, in order
# (the job, the reward server, Ray: TERM, deadline, KILL).
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/podagent/entrypoint.sh"]
CMD []
