"""The Triton kernel modules under Triton's CPU interpreter, for the tests of hosts without a GPU.

tests/conftest.py sets ``TRITON_INTERPRET=1`` on such hosts before anything imports Triton (its
own library functions, such as ``tl.sum``, are decorated at import, so it must come first).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest
import torch


def interpreted_module(name: str) -> ModuleType:
    """``name`` (a recopt module holding Triton kernels), reloaded under the interpreter.

    Skips on a GPU host (the cuda tests check the compiled kernels there) and where Triton is
    not installed (it is in the ``test`` extra; torch's CUDA builds ship their own).
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (pip install -e '.[test]' brings it)")
    if torch.cuda.is_available():
        pytest.skip("Triton compiles for the GPU here; the cuda tests check it")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tl.sum, InterpretedFunction), (
        "Triton was imported in compiled mode: TRITON_INTERPRET=1 must be set before its import "
        "(tests/conftest.py does so on hosts without a GPU)"
    )
    return importlib.reload(importlib.import_module(name))
