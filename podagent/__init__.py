"""podagent: one entrypoint that brings a multi-node Ray cluster up on GPU pods."""

__version__ = "0.1.0"
