"""Test-suite settings: Backend.AUTO is pinned, so which backend a test runs does not depend on
this machine's timings, and tests never write to ~/.cache (spawned ranks inherit both).
test_kernel_autotune.py tests the measurement with its own resolvers."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("RECOPT_BACKEND", "recopt")
os.environ.setdefault("RECOPT_CACHE_DIR", os.path.join(tempfile.gettempdir(), "recopt-test-cache"))
