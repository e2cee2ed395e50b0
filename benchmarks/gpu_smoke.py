"""First minute of a GPU session: does each piece recopt needs there load and run at all?

One line per check (``ok`` or ``FAIL`` with the error), every check run even after a failure:
versions and the device, NCCL, fbgemm's CUDA TBE (a forward and backward), Triton compiling
and running a trivial kernel (not its interpreter), recopt's Triton update kernel, a
FusedEmbeddingBagCollection step on CUDA with each backend, and what the test run needs
(pytest, pytest-timeout, hypothesis, pytest-xdist) and the TorchRec comparison (optional).

    PYTHONPATH=$PWD:/tmp/site python3 benchmarks/gpu_smoke.py   # benchmarks/gpu_session.sh runs it

Exit status 1 when a required check failed (the optional ones only report).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable

import torch

Check = Callable[[], str]


def versions() -> str:
    import triton

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
        f" triton {triton.__version__}, GPUs {torch.cuda.device_count()}: {name}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}"
    )


def cuda() -> str:
    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    assert float(x.sum()) == float((1 << 20) * ((1 << 20) - 1) / 2)
    return f"capability {torch.cuda.get_device_capability(0)}"


def nccl() -> str:
    import torch.distributed as dist

    assert dist.is_nccl_available(), "this torch has no NCCL"
    return f"NCCL {torch.cuda.nccl.version()}"


def fbgemm_tbe() -> str:
    import fbgemm_gpu
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    spec = (100, 8, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [spec, spec], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, device=torch.device("cuda")
    )
    ids = torch.tensor([1, 2, 3, 4, 5, 6], device="cuda")
    offsets = torch.tensor([0, 2, 3, 5, 6], device="cuda")
    before = tbe.split_embedding_weights()[0][1].clone()
    tbe(ids, offsets).sum().backward()
    assert not torch.equal(before, tbe.split_embedding_weights()[0][1]), "row 1 not updated"
    version = getattr(fbgemm_gpu, "__version__", "?")
    return f"fbgemm_gpu {version} from {os.path.dirname(fbgemm_gpu.__file__)}"


def triton_kernel() -> str:
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        total = tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, total, mask=mask)

    n = 1000
    x, y = torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    out = torch.empty_like(x)
    add[(triton.cdiv(n, 256),)](x, y, out, n, BLOCK=256)
    torch.testing.assert_close(out, x + y)
    return "compiled and ran"


def recopt_triton() -> str:
    from recopt.kernels import updates

    assert updates.triton_sparse_update() is not None, "recopt.kernels.triton_sparse did not import"
    module = importlib.import_module("recopt.kernels.triton_sparse")
    return f"recopt.kernels.triton_sparse imported ({module.__name__})"


def fused_step(backend: str) -> Check:
    def check() -> str:
        from recopt.kernels.config import FusedOptimizerConfig
        from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
        from recopt.sparse import KeyedJaggedTensor

        tables = [
            EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=8, feature_names=["a"])
        ]
        config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.1, backend=backend)
        ebc = FusedEmbeddingBagCollection(tables, optimizer=config, device=torch.device("cuda"))
        kjt = KeyedJaggedTensor.from_id_lists({"a": [[1, 2], [3]]}).to(torch.device("cuda"))
        before = ebc.state_dict()["embedding_bags.t0.weight"].clone()
        ebc(kjt).values().sum().backward()
        after = ebc.state_dict()["embedding_bags.t0.weight"]
        assert not torch.equal(before[1], after[1]), "row 1 not updated"
        return f"kernel {type(ebc.kernels()[0]).__name__}"

    return check


def native_cpu_kernel() -> str:
    from recopt.kernels import cpu_fused

    assert cpu_fused.available(), "no C compiler (cc/gcc): CPU tests run recopt's torch path"
    return "built with the system C compiler"


def module_version(name: str) -> Check:
    def check() -> str:
        module = importlib.import_module(name)
        return f"{name} {getattr(module, '__version__', '?')}"

    return check


REQUIRED: list[tuple[str, Check]] = [
    ("versions", versions),
    ("cuda", cuda),
    ("nccl", nccl),
    ("fbgemm TBE on CUDA", fbgemm_tbe),
    ("Triton compiles", triton_kernel),
    ("recopt Triton kernel", recopt_triton),
    ("FusedEBC step, fbgemm", fused_step("fbgemm")),
    ("FusedEBC step, recopt", fused_step("recopt")),
    ("pytest", module_version("pytest")),
    ("pytest-timeout", module_version("pytest_timeout")),
    ("hypothesis", module_version("hypothesis")),
]
OPTIONAL: list[tuple[str, Check]] = [
    ("recopt's native CPU kernel", native_cpu_kernel),
    ("pytest-xdist (parallel suite)", module_version("xdist")),
    ("torchrec (DLRM comparison)", module_version("torchrec")),
]


def main() -> int:
    failed = 0
    for required, checks in ((True, REQUIRED), (False, OPTIONAL)):
        for name, check in checks:
            try:
                sys.stdout.write(f"ok    {name}: {check()}\n")
            except Exception:  # noqa: BLE001 - report every check, whatever it raised
                last = traceback.format_exc().strip().splitlines()[-1]
                sys.stdout.write(f"{'FAIL' if required else 'absent'}  {name}: {last}\n")
                failed += required
            sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
