"""UVM as host-mapped memory (issue 23): fbgemm's TBE gets ``uvm_host_mapped=True`` for kernels
with tables off the device, where its version takes the argument (read from the signature:
fbgemm-gpu 1.8.0's CPU build here), so UVM never asks for managed memory beyond free HBM.
"""

from __future__ import annotations

import pytest

from recopt.kernels.config import TableSpec
from recopt.kernels.placement import Location, Placement, fbgemm_uvm_arguments

UVM = Placement(location=Location.UVM)
CACHED = Placement(location=Location.UVM_CACHING, cache_load_factor=0.1)


def _tables(*placements: Placement) -> list[TableSpec]:
    return [
        TableSpec(name=f"t{i}", num_embeddings=10, embedding_dim=8, placement=p)
        for i, p in enumerate(placements)
    ]


def test_fbgemms_tbe_is_asked_for_host_mapped_uvm() -> None:
    training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    tbe = training.SplitTableBatchedEmbeddingBagsCodegen
    assert fbgemm_uvm_arguments(tbe, _tables(Placement(), UVM)) == {"uvm_host_mapped": True}
    assert fbgemm_uvm_arguments(tbe, _tables(CACHED)) == {"uvm_host_mapped": True}
    # All in HBM: fbgemm is called exactly as before.
    assert fbgemm_uvm_arguments(tbe, _tables(Placement(), Placement())) == {}


def test_an_fbgemm_without_the_argument_is_called_as_before() -> None:
    class OldTbe:
        def __init__(self, embedding_specs: list[object], cache_load_factor: float = 0.2) -> None:
            pass

    assert fbgemm_uvm_arguments(OldTbe, _tables(UVM)) == {}
