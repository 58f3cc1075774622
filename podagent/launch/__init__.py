"""`podagent up`, `down` and `ls`: the user's machine creating, following and cleaning up a
run's pods through RunPod's REST API (v2)."""
