"""Test-wide hooks."""

from __future__ import annotations

import os
from pathlib import Path

# Set by tests/compat when it runs the suite again inside an environment holding another Ray:
# there only the tests marked ray_matrix are collected, so modules that need what such an
# environment lacks (torch, wandb) are never imported.
RAY_MATRIX_ONLY = "PODAGENT_RAY_MATRIX_ONLY"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if not os.environ.get(RAY_MATRIX_ONLY):
        return None
    if collection_path.name == "compat":  # the matrix is run from there: never recurse
        return True
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return "pytest.mark.ray_matrix" not in collection_path.read_text(errors="replace")
    return None
