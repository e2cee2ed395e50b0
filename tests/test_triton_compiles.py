"""recopt's Triton kernels compile for the GPU hosts' sm_90 (H100/H200) without a GPU: Triton
lowers them to PTX for a named target, so a kernel the CPU interpreter accepts but the compiler
refuses (a loop-carried value changing type, an unsupported construct) fails here, before a GPU
session. Runs in a subprocess without ``TRITON_INTERPRET`` (conftest sets it on CPU hosts, and
it must be unset when Triton is imported to compile). Skipped where Triton or its NVIDIA backend
is missing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import recopt.kernels.triton_adafactor as ada
import recopt.kernels.triton_sparse as ts

F, I = "*fp32", "*i64"
SCALARS = {"D": "i32", "lr": "fp32", "eps": "fp32", "weight_decay": "fp32", "sign": "fp32",
           "one_minus_beta1": "fp32", "one_minus_beta2": "fp32", "step_size": "fp32"}
UPDATE = {"N": "i64", **SCALARS}
STATE = {"weight_ptr": F, "s1_ptr": F, "s2_ptr": F}
ROWS = {"ids_ptr": I, "goff_ptr": I, "scale_ptr": F, "grad_ptr": F, "first_ptr": F, "last_ptr": F}
CASES = []
for opt in range(5):
    for has_scale in (False, True):
        CASES.append((ts._piece_kernel, {**ROWS, **STATE, **UPDATE},
                      {"OPT": opt, "HAS_SCALE": has_scale, "BLOCK_D": 128, "CHUNK": 64}))
    CASES.append((ts._combine_kernel,
                  {"ids_ptr": I, "first_ptr": F, "last_ptr": F, **STATE, **UPDATE},
                  {"OPT": opt, "BLOCK_D": 128, "CHUNK": 64}))
CASES.append((ada._update_sq_kernel,
              {"grad_ptr": F, "rows_ptr": I, "row_var_ptr": F, "col_var_ptr": F,
               "row_scale_ptr": F, "update_sq_ptr": F, "D": "i32", "eps1_sq": "fp32"},
              {"BLOCK_D": 64}))
CASES.append((ada._apply_kernel,
              {"weight_ptr": F, "grad_ptr": F, "rows_ptr": I, "row_var_ptr": F, "col_var_ptr": F,
               "row_scale_ptr": F, "step_size_ptr": F, "old_sq_ptr": F, "new_sq_ptr": F,
               "D": "i32", "eps1_sq": "fp32", "decay": "fp32"},
              {"BLOCK_D": 64}))
target = GPUTarget("cuda", 90, 32)
for fn, signature, constexprs in CASES:
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=target)
    assert ".target sm_90" in compiled.asm["ptx"], fn.__name__
print("compiled", len(CASES))
"""


def test_triton_kernels_compile_for_sm_90() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "recopt-triton-test")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (silences its warning)
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "compiled 17"
