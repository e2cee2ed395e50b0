"""``torchrec.distributed.embedding_types.EmbeddingComputeKernel``: TorchRec's kernel names.

recopt always runs a fused kernel; the names say where the table lives (``fused``: device
memory, ``fused_uvm``: UVM, ``fused_uvm_caching``: UVM with an HBM cache), which is what a
`ParameterConstraints` ``compute_kernels`` list selects (see `planner.types`).
"""

import enum


class EmbeddingComputeKernel(enum.Enum):
    """TorchRec's compute kernel names that recopt honours."""

    FUSED = "fused"
    FUSED_UVM = "fused_uvm"
    FUSED_UVM_CACHING = "fused_uvm_caching"
