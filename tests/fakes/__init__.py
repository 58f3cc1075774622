"""Stand-ins for outside services, served over real sockets (so the code under test speaks its
real protocol to them): RunPod's REST API."""
