"""Test-suite settings.

Tests marked ``cuda`` are skipped on a machine without a CUDA GPU, where Triton runs in its
interpreter (``TRITON_INTERPRET=1``). Tests never write to ~/.cache (``RECOPT_CACHE_DIR``).
Backend.AUTO is pinned to recopt per test (``RECOPT_BACKEND``, which spawned ranks inherit), so
which backend a test runs does not depend on this machine's timings; tests marked ``cuda`` or
``real_backend`` run unpinned and see AUTO's real choice (its refusals, its measurement). A
``RECOPT_BACKEND`` set by whoever runs pytest applies to every test.
test_kernel_autotune.py tests the measurement with its own resolvers.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch

from recopt.kernels.autotune import ENV_BACKEND, configure_auto

# A pin given by whoever runs pytest; None: tests are pinned to recopt unless marked. Pinned
# from here on too, so that nothing built while collecting the tests measures. The caller's
# value is kept aside: pytest-xdist's workers inherit this process's environment, pin
# included, and must not take the pin for the caller's.
_CALLER = "RECOPT_TESTS_CALLER_BACKEND"
os.environ.setdefault(_CALLER, os.environ.get(ENV_BACKEND, ""))
CALLER_PIN = os.environ[_CALLER] or None
os.environ[ENV_BACKEND] = CALLER_PIN or "recopt"
# Without a GPU, Triton can only interpret: set before anything imports it, so the Triton
# kernels' CPU tests (tests/test_triton_*.py) never meet a Triton imported in compiled mode.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RECOPT_CACHE_DIR", os.path.join(tempfile.gettempdir(), "recopt-test-cache"))


@pytest.fixture(autouse=True)
def _backend_pin(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pin AUTO to recopt, except for tests marked ``cuda`` or ``real_backend``.

    The process's resolver is dropped before and after, so that it re-reads the pin.
    """
    real = any(request.node.get_closest_marker(m) for m in ("cuda", "real_backend"))
    if real and CALLER_PIN is None:
        monkeypatch.delenv(ENV_BACKEND)
    configure_auto(None)
    yield
    configure_auto(None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
