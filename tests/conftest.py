"""Test-suite settings.

Tests marked ``cuda`` are skipped on a machine without a CUDA GPU, where Triton runs in its
interpreter (``TRITON_INTERPRET=1``). Backend.AUTO is pinned, so
which backend a test runs does not depend on this machine's timings, and tests never write to
~/.cache (spawned ranks inherit both); test_kernel_autotune.py tests the measurement with its
own resolvers.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

os.environ.setdefault("RECOPT_BACKEND", "recopt")
# Without a GPU, Triton can only interpret: set before anything imports it, so the Triton
# kernels' CPU tests (tests/test_triton_*.py) never meet a Triton imported in compiled mode.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RECOPT_CACHE_DIR", os.path.join(tempfile.gettempdir(), "recopt-test-cache"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
