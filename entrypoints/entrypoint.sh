#!/bin/sh
# The image's entrypoint: podagent with the container's arguments (none: detect the role and act).
# exec replaces this shell with podagent, so podagent receives the signals tini forwards and its
# exit code is the container's.
set -e
exec podagent "$@"
