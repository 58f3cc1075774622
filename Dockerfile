# podagent on a CUDA + PyTorch runtime image. The same image runs on every pod, head and
# workers alike: podagent decides each pod's role at start (see README.md).
#
#   docker build -t <registry>/podagent:0.1.0 .
#   docker build --build-arg BASE_IMAGE=<another CUDA + torch image> -t ... .
#
# The base brings CUDA, cuDNN, Python and torch. podagent declares torch>=2.4,<2.14, so the
# base's torch must lie in that range: pip then keeps it instead of fetching another build
# (a CPU wheel or a different CUDA), and the install step below pins it to make sure.
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# tini runs as PID 1: it forwards the runtime's SIGTERM to podagent and reaps orphans.
# Not version-pinned: the version differs between the distributions BASE_IMAGE may be built on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/podagent/src
COPY pyproject.toml README.md ./
COPY env ./env
COPY podagent ./podagent
# Pin the base image's torch as a constraint: should any requirement ever ask for another torch,
# the build fails here instead of silently replacing the GPU build the image was chosen for.
RUN python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
        > /tmp/base-torch.txt \
    && pip install --no-cache-dir --constraint /tmp/base-torch.txt . \
    && rm /tmp/base-torch.txt \
    && podagent --version

COPY --chmod=0755 entrypoints/entrypoint.sh /opt/podagent/entrypoint.sh

# RunPod mounts the pod's volume at /workspace: logs and checkpoints outlive the pod there.
# Secrets (PODAGENT_TOKEN, WANDB_API_KEY) never belong here: set them as RunPod secrets.
ENV PODAGENT_LOG_DIR=/workspace/podagent/logs \
    PODAGENT_CHECKPOINT_DIR=/workspace/checkpoints \
    PYTHONUNBUFFERED=1
WORKDIR /workspace

# Ray GCS, Ray dashboard and Jobs API, the reward server (podagent's defaults).
EXPOSE 6379 8265 5000

# Bring-up can take minutes (the head waits for its workers, a model-backed reward server loads):
# failures during the start period do not count.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 \
    CMD ["podagent", "status", "--local"]

# No -g: tini passes the signal to podagent alone; podagent stops its children itself, in order
# (the job, the reward server, Ray: TERM, deadline, KILL).
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/podagent/entrypoint.sh"]
CMD []
