"""The sharding contract: every sharding type equals the unsharded module, step for step.

For world sizes 1, 2 and 3 (one spawned gloo group each, every case in a loop): the sharded
forward equals the unsharded forward on this rank's rows; after 3 training steps (fused
embedding optimizer + a DDP dense layer) every weight and every optimizer state, gathered to
full tensors, equals the unsharded FusedEmbeddingBagCollection trained on the concatenation of
every rank's batch (embedding gradients sum over ranks; DDP averages dense gradients).
Embedding collections (unpooled) run the same cases: each rank's rows of each feature equal
the unsharded module's rows of that rank's ids.

Cases marked ``vbe`` feed each rank a variable batch per feature (deduplicated bags and
``inverse_indices``); their reference is the same batch expanded to one bag per sample.

The cuda variant runs the same cases with 2 and 3 ranks sharing one GPU in a group whose only
backend is ``cuda:gloo`` (like NCCL, it refuses CPU tensors): the multi-GPU logic on one GPU.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from contract_inputs import BATCHES, batch_bags, flat, inputs, kjt
from pipeline_helpers import embedding_configs
from torch import nn

from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType
from recopt.kernels.registry import OPTIMIZERS as REGISTERED_OPTIMIZERS
from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    InvalidIdError,
)
from recopt.sharding import (
    SHARDING_SPECS,
    PlanError,
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

# Every registered optimizer that runs on every sharding type. Excluded, with cases of their
# own below on the types that keep what they need whole: whole-table statistics (adafactor)
# and full-row norms (lamb, row_wise_lamb).
OPTIMIZERS = [
    name
    for name, spec in REGISTERED_OPTIMIZERS.items()
    if not (spec.whole_table_statistics or spec.full_row_norms)
]
# Every registered sharding type, plus "mixed" (several types in one module).
TYPES = [*(t.value for t in SHARDING_SPECS), "mixed"]
STEPS = 3
CPU = torch.device("cpu")
MEAN = PoolingType.MEAN


@dataclass
class Case:
    name: str
    kind: str
    optimizer: str
    weighted: bool = False
    pooling: PoolingType = PoolingType.SUM
    plain_ebc: bool = False  # the plain (not fused) module, EBC or EC
    vbe: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    unpooled: bool = False  # an EmbeddingCollection (tables as EmbeddingConfig)
    shared: bool = False  # f3 looks up t1 and t2 (outputs "f3@t1", "f3@t2")


def _optimizer(case: Case) -> FusedOptimizerConfig:
    return FusedOptimizerConfig(name=case.optimizer, lr=0.05, eps=1e-3, **case.extra)


def _tables(case: Case) -> list[EmbeddingBagConfig]:
    # Rows not divisible by 2 or 3 (uneven row shards); dims that split into 2 and 3 column
    # shards (6: widths not multiples of 4, so fbgemm falls back to recopt); t1 has two
    # features; mixed poolings. Shared: f3 (ids < 7) also looks up t1, after f1 and f2.
    return [
        EmbeddingBagConfig(
            name="t0",
            num_embeddings=11,
            embedding_dim=12,
            feature_names=["f0"],
            pooling=case.pooling,
        ),
        EmbeddingBagConfig(
            name="t1",
            num_embeddings=13,
            embedding_dim=12,
            feature_names=["f1", "f2", "f3"] if case.shared else ["f1", "f2"],
            pooling=PoolingType.SUM,
        ),
        EmbeddingBagConfig(
            name="t2",
            num_embeddings=7,
            embedding_dim=6,
            feature_names=["f3"],
            pooling=PoolingType.MEAN,
        ),
    ]


def _requests(kind: str, world: int) -> dict[str, Any]:
    last = world - 1
    if kind == "table_wise":
        return {"t0": table_wise(0), "t1": table_wise(last), "t2": table_wise(min(1, last))}
    if kind == "row_wise":
        return {t: row_wise() for t in ("t0", "t1", "t2")}
    if kind == "column_wise":
        # Repeated ranks: several column shards on one rank.
        return {
            "t0": column_wise([last, 0]),
            "t1": column_wise([0] + list(range(world))),
            "t2": column_wise([0]),
        }
    if kind == "table_row_wise":
        return {t: table_row_wise(0) for t in ("t0", "t1", "t2")}
    if kind == "table_column_wise":
        return {t: table_column_wise(0) for t in ("t0", "t1", "t2")}
    if kind == "one_rank":  # every other rank holds nothing and still joins every collective
        return {t: table_wise(0) for t in ("t0", "t1", "t2")}
    if kind == "data_parallel":
        return {t: data_parallel() for t in ("t0", "t1", "t2")}
    if kind == "mixed":
        return {"t0": row_wise(), "t1": column_wise([last, 0]), "t2": data_parallel()}
    raise AssertionError(f"sharding type {kind!r} has no requests here; add its layout above")


def _cases() -> list[Case]:
    cases = [Case(f"{k}/{o}", k, o) for k in TYPES for o in OPTIMIZERS]
    cases += [Case(f"{k}/adafactor", k, "adafactor") for k in ("table_wise", "data_parallel")]
    cases += [
        Case("mixed/weighted-mean", "mixed", "adagrad", weighted=True, pooling=PoolingType.MEAN),
        Case("row_wise/weighted", "row_wise", "row_wise_adam", weighted=True),
        Case("mixed/plain-ebc", "mixed", "adagrad", plain_ebc=True),
        Case("one_rank/row_wise_adam", "one_rank", "row_wise_adam", weighted=True),
        Case(
            "mixed/weighted-mean-row-wise",
            "mixed",
            "row_wise_adagrad",
            weighted=True,
            pooling=PoolingType.MEAN,
        ),
        Case(
            "column_wise/decay-maximize",
            "column_wise",
            "row_wise_adam",
            extra={"weight_decay": 0.01, "maximize": True},
        ),
        Case("table_wise/vbe", "table_wise", "adagrad", vbe=True),
        Case("row_wise/vbe-weighted", "row_wise", "row_wise_adam", weighted=True, vbe=True),
        Case("column_wise/vbe", "column_wise", "row_wise_adagrad", vbe=True),
        Case("data_parallel/vbe-mean", "data_parallel", "adam", pooling=PoolingType.MEAN, vbe=True),
        Case("mixed/plain-ebc-vbe", "mixed", "sgd", plain_ebc=True, vbe=True),
        Case("table_wise/shared", "table_wise", "adagrad", shared=True),
        Case("row_wise/shared-weighted-mean", "row_wise", "row_wise_adam", True, MEAN, shared=True),
        Case("column_wise/shared", "column_wise", "row_wise_adagrad", shared=True),
        Case("data_parallel/shared-vbe", "data_parallel", "adam", vbe=True, shared=True),
        Case("mixed/shared-plain-ebc", "mixed", "sgd", plain_ebc=True, shared=True),
    ]
    # LAMB's trust ratio needs whole rows: every type but the column splits (a few cases).
    cases += [
        Case("table_wise/lamb", "table_wise", "lamb", weighted=True, extra={"weight_decay": 0.01}),
        Case("row_wise/row_wise_lamb", "row_wise", "row_wise_lamb", True, MEAN, shared=True),
        Case("table_row_wise/lamb", "table_row_wise", "lamb", extra={"maximize": True}),
        Case("data_parallel/row_wise_lamb", "data_parallel", "row_wise_lamb", vbe=True),
    ]
    # One optimizer per type for the embedding collections (a new type needs its entry).
    ec_optimizer = {
        "table_wise": "adagrad",
        "row_wise": "row_wise_adam",
        "column_wise": "row_wise_adagrad",
        "table_row_wise": "sgd",
        "table_column_wise": "adam",
        "data_parallel": "adam",
        "mixed": "sgd",
    }
    cases += [Case(f"ec/{k}/{ec_optimizer[k]}", k, ec_optimizer[k], unpooled=True) for k in TYPES]
    cases += [
        Case("ec/table_wise/adafactor", "table_wise", "adafactor", unpooled=True),
        Case("ec/mixed/plain-ec", "mixed", "adam", plain_ebc=True, unpooled=True),
        Case("ec/row_wise/shared", "row_wise", "row_wise_adagrad", unpooled=True, shared=True),
        Case("ec/column_wise/shared", "column_wise", "adam", unpooled=True, shared=True),
        Case("ec/row_wise/lamb", "row_wise", "lamb", unpooled=True),
        Case("ec/mixed/shared-plain", "mixed", "sgd", plain_ebc=True, unpooled=True, shared=True),
    ]
    return cases


def _unpooled_tables(case: Case) -> list[EmbeddingConfig]:
    return embedding_configs(_tables(case))


class _UnpooledModel(nn.Module):
    """Each feature's rows (zero-padded to width 12) through one dense layer."""

    def __init__(self, sparse: nn.Module) -> None:
        super().__init__()
        self.sparse = sparse
        self.dense = nn.Linear(12, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows = {f: jt.values() for f, jt in self.sparse(kjt).items()}
        padded = [nn.functional.pad(r, (0, 12 - r.shape[1])) for r in rows.values()]
        return rows, self.dense(torch.cat(padded)).square().sum()


class _Model(nn.Module):
    def __init__(self, sparse: nn.Module, dim: int) -> None:
        super().__init__()
        self.sparse = sparse
        self.dense = nn.Linear(dim, 1)
        self.keys: list[str] = []  # the output keys of the last forward

    def forward(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.sparse(kjt)
        self.keys, pooled = out.keys(), out.values()
        return pooled, self.dense(pooled).square().sum()


def _build(case: Case, device: torch.device = CPU) -> nn.Module:
    tables = _tables(case)
    torch.manual_seed(0)
    opt = _optimizer(case)
    sparse: nn.Module
    if case.unpooled:
        if case.plain_ebc:
            sparse = EmbeddingCollection(_unpooled_tables(case), device=device)
        else:
            sparse = FusedEmbeddingCollection(_unpooled_tables(case), opt, device=device)
        return _UnpooledModel(sparse).to(device)
    if case.plain_ebc:
        sparse = EmbeddingBagCollection(tables, is_weighted=case.weighted, device=device)
    else:
        sparse = FusedEmbeddingBagCollection(
            tables, optimizer=opt, is_weighted=case.weighted, device=device
        )
    model = _Model(sparse, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    model.dense.to(device)
    return model


def _global_rows(rank: int, world: int) -> slice:
    start = sum(BATCHES[:rank])
    return slice(start, start + BATCHES[rank])


def _run_case(case: Case, rank: int, world: int, device: torch.device = CPU) -> None:
    from recopt.sharding.model_parallel import DistributedModelParallel
    from recopt.sharding.state import full_tensor

    model = _build(case, device)
    ref = _build(case, device)  # not a deepcopy: kernels alias their weights, a copy would not
    if case.plain_ebc:  # the reference of a plain module is the fused twin with the same weights
        fused: nn.Module
        if case.unpooled:
            fused = FusedEmbeddingCollection(
                _unpooled_tables(case), _optimizer(case), device=device
            )
        else:
            fused = FusedEmbeddingBagCollection(
                _tables(case), optimizer=_optimizer(case), is_weighted=case.weighted, device=device
            )
        fused.load_state_dict(model.sparse.state_dict())
        ref.sparse = fused
    requests = _requests(case.kind, world)
    plan = ShardingPlan({"sparse": construct_module_sharding_plan(_tables(case), requests, world)})
    default = _optimizer(case)
    dmp = DistributedModelParallel(model, plan, default_optimizer=default, device=device)
    dense_opt = torch.optim.SGD([p for _, p in dmp.named_parameters()], lr=0.01)
    ref_dense = torch.optim.SGD(ref.dense.parameters(), lr=0.01)
    for step in range(STEPS):
        mine, everyone = inputs(case.vbe, case.weighted, rank, step, world)
        pooled, loss = dmp(mine.to(device))
        ref_pooled, ref_loss = ref(everyone.to(device))
        assert getattr(dmp.plain_module, "keys", None) == getattr(ref, "keys", None), case.name
        keys = list(ref_pooled) if case.unpooled else ref.keys
        assert not case.shared or keys[-2:] == ["f3@t1", "f3@t2"], (case.name, keys)
        if case.unpooled:
            bags = [batch_bags(r, step) for r in range(world)]
            pooled, ref_pooled = _rank_rows(pooled, ref_pooled, bags, rank)
        torch.testing.assert_close(
            pooled,
            ref_pooled if case.unpooled else ref_pooled[_global_rows(rank, world)],
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, s=step: f"{case.name} step {s} forward: {m}",
        )
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        ref_dense.zero_grad()
        ref_loss.backward()
        for p in ref.dense.parameters():
            assert p.grad is not None
            p.grad /= world  # DDP averages dense gradients over ranks
        ref_dense.step()
    state = dmp.state_dict()
    ref_state = ref.state_dict()
    assert sorted(state) == sorted(ref_state), (case.name, sorted(state), sorted(ref_state))
    for key, value in ref_state.items():
        torch.testing.assert_close(
            full_tensor(state[key]),
            value,
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, k=key: f"{case.name} {k}: {m}",
        )
    opt_state = dmp.fused_optimizer.state_dict()["state"]
    ref_opt = ref.sparse.fused_optimizer.state_dict()["state"]
    assert sorted(opt_state) == sorted(f"sparse.{k}" for k in ref_opt), case.name
    for key, states in ref_opt.items():
        mine = opt_state[f"sparse.{key}"]
        assert sorted(mine) == sorted(states), (case.name, key, sorted(mine), sorted(states))
        for name, value in states.items():
            got = full_tensor(mine[name])
            assert got.shape == value.shape, (case.name, name, got.shape, value.shape)
            torch.testing.assert_close(
                got.to(value.dtype),
                value,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, n=name: f"{case.name} {n}: {m}",
            )


def _rank_rows(
    rows: dict[str, torch.Tensor],
    ref_rows: dict[str, torch.Tensor],
    bags: list[dict[str, list[list[int]]]],
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of every feature, and the reference's rows of this rank's ids."""
    ids = [{f: sum(len(b) for b in per_rank[f]) for f in per_rank} for per_rank in bags]
    assert list(rows) == list(ref_rows)
    mine, theirs = [], []
    for key, value in rows.items():
        f = key.split("@")[0]  # a shared feature's output "f3@t1" holds f3's ids
        start = sum(ids[r][f] for r in range(rank))
        assert value.shape[0] == ids[rank][f]
        mine.append(value.reshape(-1))
        theirs.append(ref_rows[key][start : start + ids[rank][f]].reshape(-1))
    return torch.cat(mine), torch.cat(theirs)


def _errors_case(rank: int, world: int) -> None:
    """Bad plans fail before any collective; bad ids on one rank raise on every rank."""
    from recopt.sharding.input_dist import RemoteInputError
    from recopt.sharding.model_parallel import DistributedModelParallel

    case = Case("errors", "row_wise", "adam")
    tables = _tables(case)
    bad_plan = ShardingPlan(
        {"sparse": construct_module_sharding_plan(tables, _requests("row_wise", world), world)}
    )
    del bad_plan.plan["sparse"]["t2"]
    with pytest.raises(PlanError, match="t2"):
        DistributedModelParallel(_build(case), bad_plan)
    ada = FusedOptimizerConfig(name="adafactor")
    ada_plan = ShardingPlan(
        {
            "sparse": construct_module_sharding_plan(
                tables, {**_requests("row_wise", world), "t0": row_wise(optimizer=ada)}, world
            )
        }
    )
    with pytest.raises(PlanError, match="adafactor"):
        DistributedModelParallel(_build(case), ada_plan)
    lamb = FusedOptimizerConfig(name="row_wise_lamb")
    lamb_plan = ShardingPlan(
        {
            "sparse": construct_module_sharding_plan(
                tables,
                {**_requests("row_wise", world), "t1": column_wise([0], optimizer=lamb)},
                world,
            )
        }
    )
    with pytest.raises(PlanError, match="'t1'.*row_wise_lamb.*cannot run on column shards"):
        DistributedModelParallel(_build(case), lamb_plan)
    rw = FusedOptimizerConfig(name="row_wise_adagrad")
    fb_plan = ShardingPlan(
        {
            "sparse": construct_module_sharding_plan(
                tables,
                {
                    **_requests("row_wise", world),
                    "t1": column_wise([0], backend=Backend.FBGEMM, optimizer=rw),
                },
                world,
            )
        }
    )
    with pytest.raises(PlanError, match="'t1'.*recopt"):
        DistributedModelParallel(_build(case), fb_plan)
    plan = ShardingPlan(
        {"sparse": construct_module_sharding_plan(tables, _requests("mixed", world), world)}
    )
    dmp = DistributedModelParallel(_build(case), plan)
    before = {k: v.detach().clone() for k, v in _full_state(dmp).items()}
    bags = batch_bags(rank, 0)
    if rank == world - 1:
        bags["f1"][0] = [13]  # out of range for t1 (13 rows)
    if rank == world - 1:
        with pytest.raises(InvalidIdError, match="'t1'.*13"):
            dmp(kjt([bags], False))
    else:
        with pytest.raises(RemoteInputError, match=f"rank\\(s\\) \\[{world - 1}\\]"):
            dmp(kjt([bags], False))
    # Nothing was updated, and the next good step works on every rank.
    for key, value in _full_state(dmp).items():
        torch.testing.assert_close(value, before[key], atol=0, rtol=0)
    _, loss = dmp(kjt([batch_bags(rank, 0)], False))
    loss.backward()
    # A variable batch without inverse_indices on one rank: every rank raises, nothing changes.
    keys, ids, lengths, _ = flat([{"f0": [[1], [2]], "f1": [[3]], "f2": [[]], "f3": [[0]]}], False)
    vbe = KeyedJaggedTensor(
        keys, ids, lengths=lengths, stride_per_key_per_rank=[[2], [1], [1], [1]]
    )
    before = {k: v.detach().clone() for k, v in _full_state(dmp).items()}
    if rank == 0:
        with pytest.raises(ValueError, match="no inverse_indices"):
            dmp(vbe)
    else:
        with pytest.raises(RemoteInputError, match="rank\\(s\\) \\[0\\]"):
            dmp(kjt([batch_bags(rank, 1)], False))
    for key, value in _full_state(dmp).items():
        torch.testing.assert_close(value, before[key], atol=0, rtol=0)


def _state_case(rank: int, world: int) -> None:
    """Weights load from full tensors and ShardedTensors; optimizer state loads into every
    replica (row-wise state of column shards), so training continues identically."""
    from recopt.sharding.model_parallel import DistributedModelParallel
    from recopt.sharding.state import full_tensor

    case = Case("state", "mixed", "row_wise_adagrad")
    tables = _tables(case)

    def make(seed: int) -> Any:
        plan = ShardingPlan(
            {"sparse": construct_module_sharding_plan(tables, _requests("mixed", world), world)}
        )
        torch.manual_seed(seed)
        model = _Model(
            FusedEmbeddingBagCollection(
                tables, optimizer=FusedOptimizerConfig(name=case.optimizer)
            ),
            42,
        )
        return DistributedModelParallel(model, plan)

    a, b = make(0), make(1)
    for step, dmp in ((0, a), (1, b)):
        _, loss = dmp(kjt([batch_bags(rank, step)], False))
        loss.backward()
    # Full tensors: this rank's rectangles are copied.
    doubled = {k: full_tensor(v) * 2 for k, v in a.state_dict().items()}
    a.load_state_dict(doubled)
    for k, v in _full_state(a).items():
        torch.testing.assert_close(v, doubled[k], atol=0, rtol=0)
    # ShardedTensors of the same layout: the overlapping local shards are copied.
    a.load_state_dict(b.state_dict())
    for k, v in _full_state(b).items():
        torch.testing.assert_close(_full_state(a)[k], v, atol=0, rtol=0)
    # Optimizer state: every key, including the replicas of t1's row-wise state.
    a.fused_optimizer.load_state_dict(b.fused_optimizer.state_dict())
    for step in (2, 3):
        for dmp in (a, b):
            _, loss = dmp(kjt([batch_bags(rank, step)], False))
            loss.backward()
    for k, v in _full_state(b).items():
        if k.startswith("sparse."):
            torch.testing.assert_close(_full_state(a)[k], v, atol=1e-6, rtol=1e-6)
    sa = a.fused_optimizer.state_dict()["state"]
    sb = b.fused_optimizer.state_dict()["state"]
    for param, states in sb.items():
        for name, value in states.items():
            torch.testing.assert_close(
                full_tensor(sa[param][name]), full_tensor(value), atol=1e-6, rtol=1e-6
            )


def _wrapper_case(rank: int, world: int, device: torch.device = CPU) -> None:
    """The planner's plan by default; the fused optimizer combines with a dense one under the
    unsharded model's parameter names."""
    from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
    from recopt.sharding.model_parallel import DistributedModelParallel

    case = Case("wrapper", "mixed", "adam")
    reference_names = {n for n, _ in _build(case).named_parameters()}
    dmp = DistributedModelParallel(_build(case, device), device=device)  # the planner's plan
    assert set(dmp.plan.plan) == {"sparse"} and set(dmp.plan["sparse"]) == {"t0", "t1", "t2"}
    dense = KeyedOptimizerWrapper(
        dict(dmp.named_parameters()), lambda ps: torch.optim.Adagrad(ps, lr=0.1)
    )
    combined = CombinedOptimizer([dmp.fused_optimizer, dense])
    _, loss = dmp(kjt([batch_bags(rank, 0)], False).to(device))
    combined.zero_grad()
    loss.backward()
    combined.step()
    assert set(combined.state_dict()["state"]) == reference_names
    assert set(dmp.state_dict()) == reference_names


def _full_state(dmp: Any) -> dict[str, torch.Tensor]:
    from recopt.sharding.state import full_tensor

    return {k: full_tensor(v) for k, v in dmp.state_dict().items()}


def _contract(rank: int, world: int) -> list[str]:
    with warnings.catch_warnings():
        # As pytest's config does in this process: a FutureWarning raised from recopt (e.g.
        # ShardedTensor's deprecation reaching a user through recopt) is an error.
        warnings.filterwarnings("error", category=FutureWarning, module=r"recopt(\..*)?$")
        done = []
        for case in _cases():
            _run_case(case, rank, world)
            done.append(case.name)
        _errors_case(rank, world)
        done.append("errors")
        _state_case(rank, world)
        done.append("state")
        _wrapper_case(rank, world)
        done.append("wrapper")
    return done


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharding_contract(world: int) -> None:
    results = run_on_ranks(_contract, world, timeout_s=240)
    assert all(r == results[0] for r in results)
    assert len(results[0]) == len(_cases()) + 3


CUDA_PARTS = 3  # the cases split so that each part's ranks end well within pytest's 300 s


def _contract_cuda(rank: int, world: int, part: int) -> list[str]:
    device = torch.device("cuda", torch.cuda.current_device())
    done = []
    for case in _cases()[part::CUDA_PARTS]:
        _run_case(case, rank, world, device)
        done.append(case.name)
    if part == 0:
        _wrapper_case(rank, world, device)  # the planner's plan broadcast in a CUDA-only group
        done.append("wrapper")
    return done


@pytest.mark.cuda
@pytest.mark.parametrize("part", range(CUDA_PARTS))
@pytest.mark.parametrize("world", [2, 3])
def test_sharding_contract_on_ranks_sharing_one_gpu(world: int, part: int) -> None:
    results = run_on_ranks(_contract_cuda, world, part, timeout_s=240, backend="cuda:gloo")
    assert all(r == results[0] for r in results)
    want = [case.name for case in _cases()[part::CUDA_PARTS]] + (["wrapper"] if part == 0 else [])
    assert results[0] == want
