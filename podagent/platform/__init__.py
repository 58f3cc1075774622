"""Platform facts: this pod, NCCL, where the head is, roles, RunPod's API."""
