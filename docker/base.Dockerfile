# A stand-in for a trainer's image (the OpenRLHF stack, a plain Ray image), to build podagent's
# Dockerfile on where no registry can be reached. docker/images.py makes ROOTFS (Debian from
# debootstrap, imported) and the context: requirements.txt (a CPU torch wheel and the stack's
# pins), pip.conf and the CA bundle that this machine's pip trusts.
ARG ROOTFS=podagent-rootfs
FROM ${ROOTFS}

# The CA bundle the build machine's pip trusts, so this image's pip reaches PyPI from the same
# network (a proxy that re-signs TLS needs its own CA); podagent's build uses it too.
COPY pip.conf /etc/pip.conf
COPY ca-bundle.pem /etc/ssl/certs/pip-ca-bundle.pem

# python and pip on PATH, as in the pytorch and conda images: a virtual environment, since
# Debian's own Python refuses pip installs. The context is bind-mounted, so the torch wheel
# is not kept in a layer of its own.
ENV PATH=/opt/venv/bin:$PATH
RUN --mount=type=bind,target=/tmp/context \
    python3 -m venv /opt/venv \
    && pip install --no-cache-dir --requirement /tmp/context/requirements.txt
