"""recopt.torchrec: TorchRec's import paths and signatures over recopt (no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from recopt.kernels.config import FusedOptimizerConfig
from recopt.sparse import KeyedJaggedTensor as RecoptKJT

# The import lines of a TorchRec tutorial script, with `torchrec` replaced.
from recopt.torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)
from recopt.torchrec.distributed import DistributedModelParallel  # noqa: F401
from recopt.torchrec.distributed.embedding import EmbeddingCollectionSharder
from recopt.torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from recopt.torchrec.distributed.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)
from recopt.torchrec.distributed.types import ShardingType
from recopt.torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from recopt.torchrec.modules.mlp import MLP
from recopt.torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper  # noqa: F401
from recopt.torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: F401
from recopt.torchrec.sparse.jagged_tensor import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    jt_is_equal,
    kjt_is_equal,
)


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        weights=torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]),
        lengths=torch.tensor([2, 0, 1, 2]),
    )


def test_top_level_names_are_recopts() -> None:
    assert KeyedJaggedTensor is RecoptKJT
    assert PoolingType.SUM == "sum" and EmbeddingBagCollection.__module__.startswith("recopt.")


def _double_floats(t: torch.Tensor | None) -> torch.Tensor | None:
    return t * 2 if t is not None and t.is_floating_point() else t


def test_kjt_round_trips_through_pytree() -> None:
    kjt = _kjt()
    leaves, spec = pytree.tree_flatten({"x": kjt})
    # TorchRec's leaves: values, weights, lengths, offsets, stride_per_key_per_rank, inverse
    assert len(leaves) == 6 and [leaf is None for leaf in leaves[3:]] == [True, True, True]
    doubled = pytree.tree_map(_double_floats, {"x": kjt})["x"]
    assert isinstance(doubled, KeyedJaggedTensor) and doubled.keys() == ["a", "b"]
    assert torch.equal(doubled.weights(), kjt.weights() * 2)
    assert torch.equal(doubled["b"].values(), kjt["b"].values())
    back = pytree.tree_unflatten(leaves, spec)["x"]
    assert kjt_is_equal(back, kjt)


def test_variable_batch_kjt_from_offsets_round_trips_through_pytree() -> None:
    inverse = torch.tensor([[0, 1, 0], [0, 0, 0]])
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.arange(6),
        offsets=torch.tensor([0, 2, 2, 3, 4, 5, 6]),
        stride_per_key_per_rank=[[2], [4]],
        inverse_indices=(["a", "b"], inverse),
    )
    leaves, spec = pytree.tree_flatten(kjt)
    back = pytree.tree_unflatten(leaves, spec)
    assert back.lengths_or_none() is None and torch.equal(back.offsets(), kjt.offsets())
    assert back.stride_per_key_per_rank() == [[2], [4]] and back.stride_per_key() == [2, 4]
    assert torch.equal(back.inverse_indices()[1], inverse) and kjt_is_equal(back, kjt)
    with pytest.raises(ValueError):
        pytree.tree_unflatten(leaves + leaves, spec)


def test_jt_and_kt_round_trip_through_pytree() -> None:
    jt = JaggedTensor(values=torch.arange(4.0), lengths=torch.tensor([3, 1]))
    kt = KeyedTensor(keys=["a", "b"], length_per_key=[2, 1], values=torch.arange(6.0).view(2, 3))
    jt2, kt2 = pytree.tree_map(lambda t: None if t is None else t + 0, (jt, kt))
    assert jt_is_equal(jt2, jt) and jt2 is not jt
    assert kt2.keys() == ["a", "b"] and torch.equal(kt2["b"], kt["b"])


def test_kt_flatten_spec_follows_the_specs_key_order() -> None:
    from torch.fx._pytree import tree_flatten_spec

    kt = KeyedTensor(keys=["a", "b"], length_per_key=[2, 1], values=torch.arange(6.0).view(2, 3))
    _, spec = pytree.tree_flatten(kt)
    swapped = KeyedTensor(["b", "a"], [1, 2], torch.cat([kt["b"], kt["a"]], dim=1))
    assert torch.equal(tree_flatten_spec(swapped, spec)[0], kt.values())


def test_kjt_is_equal_tells_differences() -> None:
    kjt = _kjt()
    assert kjt_is_equal(kjt, _kjt())
    other = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4, 6]),
        weights=torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]),
        lengths=torch.tensor([2, 0, 1, 2]),
    )
    assert not kjt_is_equal(kjt, other)
    assert not kjt_is_equal(kjt, kjt.permute([1, 0]))
    assert not kjt_is_equal(kjt, "not a kjt")  # type: ignore[arg-type]


def test_kjt_and_jt_dict_modules() -> None:
    kjt = _kjt()
    jts = ComputeKJTToJTDict()(kjt)
    assert list(jts) == ["a", "b"] and jts["b"].values().tolist() == [3, 4, 5]
    assert kjt_is_equal(ComputeJTDictToKJT()(jts), kjt)


def test_lengths_or_none_is_none_for_offsets_only() -> None:
    values = torch.tensor([1, 2, 3])
    from_offsets = KeyedJaggedTensor(["a"], values, offsets=torch.tensor([0, 2, 3]))
    assert from_offsets.lengths_or_none() is None
    assert from_offsets.lengths().tolist() == [2, 1]
    from_lengths = KeyedJaggedTensor(["a"], values, lengths=torch.tensor([2, 1]))
    assert from_lengths.lengths_or_none().tolist() == [2, 1]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fused_params", "expected"),
    [
        (
            {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
            FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, eps=1e-8),
        ),
        (
            {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01, "beta1": 0.8, "eps": 1e-6},
            FusedOptimizerConfig(name="adam", lr=0.01, eps=1e-6, betas=(0.8, 0.999)),
        ),
        ({"optimizer": "exact_sgd"}, FusedOptimizerConfig(name="sgd", lr=0.01, eps=1e-8)),
        (None, None),
    ],
)
def test_sharder_fused_params_map_to_fused_optimizers(
    fused_params: dict[str, object] | None, expected: FusedOptimizerConfig | None
) -> None:
    assert EmbeddingBagCollectionSharder(fused_params=fused_params).optimizer == expected


def test_sharder_refuses_what_it_cannot_map() -> None:
    with pytest.raises(ValueError, match="SHAMPOO|shampoo"):
        EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.SHAMPOO})
    with pytest.raises(ValueError, match="'prefetch_pipeline'"):
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.ADAM, "prefetch_pipeline": True}
        )
    with pytest.raises(ValueError, match="qcomm_codecs_registry"):
        EmbeddingCollectionSharder(qcomm_codecs_registry={"forward": object()})


def test_topology_takes_torchrecs_arguments() -> None:
    topology = Topology(world_size=4, compute_device="cuda", local_world_size=2, inter_host_bw=2.0)
    assert (topology.world_size, topology.device, topology.ranks_per_host) == (4, "cuda", 2)
    assert topology.hbm_bytes == 32 * 1024**3 and topology.inter_host_bandwidth == 2000.0
    assert Topology(2, "cpu", ddr_cap=10**9).ddr_bytes == 10**9
    with pytest.raises(ValueError, match="ssd_cap"):
        Topology(2, "cpu", ssd_cap=10**9)


def test_parameter_constraints_convert() -> None:
    constraints = ParameterConstraints(
        sharding_types=[ShardingType.ROW_WISE.value],
        compute_kernels=["fused_uvm_caching"],
        pooling_factors=[2.0, 4.0],
        batch_sizes=[64, 128],
    ).to_recopt()
    assert constraints.sharding_types == (ShardingType.ROW_WISE,)
    assert constraints.pooling_factor == 3.0 and constraints.batch_size == 128
    assert constraints.placements is not None
    assert [p.location for p in constraints.placements] == ["uvm_caching"]
    with pytest.raises(ValueError, match="'dense'"):
        ParameterConstraints(compute_kernels=["dense"]).to_recopt()
    with pytest.raises(ValueError, match="enforce_hbm"):
        ParameterConstraints(enforce_hbm=True).to_recopt()


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1"]),
    ]


def test_planner_plans_a_module_with_sharders_and_constraints() -> None:
    model = torch.nn.Module()
    model.sparse = EmbeddingBagCollection(_tables(), device=torch.device("meta"))
    constraints = {"t1": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])}
    planner = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=constraints)
    plan = planner.plan(model, [EmbeddingBagCollectionSharder()])
    assert set(plan["sparse"]) == {"t0", "t1"}
    assert plan["sparse"]["t1"].sharding_type is ShardingType.ROW_WISE
    with pytest.raises(ValueError, match="proposer"):
        EmbeddingShardingPlanner(Topology(2, "cpu"), proposer=object())


def test_mlp_matches_linear_layers() -> None:
    torch.manual_seed(0)
    mlp = MLP(6, [5, 3], activation=torch.sigmoid, activation_on_last=False)
    x = torch.randn(4, 6)
    first, last = mlp._mlp[0].linear, mlp._mlp[1]
    want = torch.nn.functional.linear(torch.sigmoid(first(x)), last.weight, last.bias)
    assert torch.allclose(mlp(x), want, atol=1e-6)
    relu = MLP(6, [5], device="cpu", dtype=torch.float64)
    x64 = x.double()
    assert relu._mlp[0].weight.dtype == torch.float64
    want = torch.relu(torch.nn.functional.linear(x64, relu._mlp[0].weight, relu._mlp[0].bias))
    assert torch.allclose(relu(x64), want)
    with pytest.raises(ValueError, match="swish_layernorm"):
        MLP(6, [5], activation="swish_layernorm")


def _dlrm_batch() -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    sparse = KeyedJaggedTensor.from_id_lists({"f0": [[1, 2], [3]], "f1": [[4], []]})
    return torch.randn(2, 5), sparse, torch.tensor([1.0, 0.0])


def test_dlrm_signatures_and_outputs() -> None:
    from recopt.models import DLRM as RecoptDLRM
    from recopt.models import DLRMConfig

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables())
    model = DLRM(ebc, 5, [16, 8], [12, 1])
    reference = RecoptDLRM(ebc, DLRMConfig(dense_in_features=5, bottom_mlp=(16, 8), top_mlp=(12,)))
    reference.load_state_dict(model.state_dict())
    dense, sparse, labels = _dlrm_batch()
    logits = model(dense, sparse)
    assert logits.shape == (2, 1) and torch.equal(logits[:, 0], reference(dense, sparse))
    loss, (detached, out, got_labels) = DLRMTrain(model)(_batch(dense, sparse, labels))
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], labels)
    assert torch.allclose(loss, want) and torch.equal(out, logits[:, 0].detach())
    assert torch.equal(got_labels, labels) and not detached.requires_grad
    dcn = DLRM_DCN(ebc, 5, [16, 8], [12, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    assert dcn(dense, sparse).shape == (2, 1) and len(dcn.interaction.up) == 2
    with pytest.raises(ValueError, match="must end with 1"):
        DLRM(ebc, 5, [16, 8], [12, 2])


def _batch(dense: torch.Tensor, sparse: KeyedJaggedTensor, labels: torch.Tensor):  # type: ignore[no-untyped-def]
    from recopt.torchrec.datasets.utils import Batch

    return Batch(dense_features=dense, sparse_features=sparse, labels=labels)


def test_train_pipeline_name_is_guarded() -> None:
    import recopt.sharding
    from recopt.torchrec.distributed import train_pipeline

    offered = hasattr(recopt.sharding, "TrainPipelineSparseDist")
    assert hasattr(train_pipeline, "TrainPipelineSparseDist") == offered
    if not offered:
        with pytest.raises(AttributeError, match="TrainPipelineSparseDist"):
            train_pipeline.TrainPipelineSparseDist  # noqa: B018
    assert dataclasses.is_dataclass(ParameterConstraints)


def test_construct_module_sharding_plan_reads_the_modules_tables() -> None:
    from recopt.torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        table_wise,
    )

    ebc = EmbeddingBagCollection(_tables(), device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        ebc, {"t0": table_wise(rank=1), "t1": column_wise(ranks=[0, 1])}, world_size=2
    )
    assert plan["t0"].sharding_type is ShardingType.TABLE_WISE and plan["t0"].ranks == (1,)
    assert [s.num_cols for s in plan["t1"].shards] == [4, 4]
    with pytest.raises(ValueError, match="not an embedding collection"):
        construct_module_sharding_plan(torch.nn.Linear(2, 2), {}, world_size=2)
