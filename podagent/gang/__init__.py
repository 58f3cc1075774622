"""Runs without Ray: torchrun or accelerate launched on every pod, supervised together."""
