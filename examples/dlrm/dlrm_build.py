"""Build one DLRM run from its config: model, sharding, optimizers and data streams.

Kept apart from train.py (the entry point and loop) so benchmarks can build the same run
without the loop; ``RunEnv`` is here because every builder takes it.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import TYPE_CHECKING, Any

import torch
from dlrm_config import TrainingConfig
from dlrm_data import data_source
from dlrm_memory import check_host_memory, host_ranks
from torch import nn

from recopt.data.batch import BatchIterator
from recopt.models import DLRM
from recopt.modules import FusedEmbeddingBagCollection
from recopt.optim import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    fused_optimizers,
    is_fused,
    split_fused_parameters,
)
from recopt.optim.clipping import GradientClippingOptimizer
from recopt.optim.warmup import WarmupOptimizer

if TYPE_CHECKING:
    from recopt.sharding.planner import Topology


@dataclasses.dataclass(frozen=True)
class RunEnv:
    """Where this process sits: rank, world size, device (read from torchrun's variables)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    local_world_size: int | None = None  # ranks on this host (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# ---------------------------------------------------------------------------------------------
# Building the run: model, sharding, optimizers, data
# ---------------------------------------------------------------------------------------------


def build_model(
    config: TrainingConfig, device: torch.device, *, embeddings_on_meta: bool = False
) -> DLRM:
    """The unsharded model: fused embedding bags + DLRM / DCNv2 dense part, seeded.

    Args:
        config: the run.
        device: where the dense part (and, unless on meta, the tables) is built.
        embeddings_on_meta: build the tables on the meta device (no memory): the
            model-parallel wrapper then allocates only this rank's shards (`shard_model`).
    """
    torch.manual_seed(config.training.seed)
    ebc = FusedEmbeddingBagCollection(
        config.embedding.tables,
        optimizer=config.embedding.optimizer,
        device=torch.device("meta") if embeddings_on_meta else device,
        table_placements=config.embedding.placements,
    )
    model = DLRM(ebc, config.model)
    for child in model.children():
        if child is not ebc:
            child.to(device)
    return model


def shard_model(model: DLRM, config: TrainingConfig, env: RunEnv) -> nn.Module:
    """PLUG-IN (sharding): one rank trains the model as is; on N ranks the planner (topology
    from ``[planner]``) chooses a plan on rank 0, every rank receives it, and the model-parallel
    wrapper shards the embedding bags by it and wraps the dense rest in DDP.
    """
    if env.world_size == 1:
        return model
    from recopt.sharding.model_parallel import DistributedModelParallel
    from recopt.sharding.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        plan_collectively,
    )

    timeout = datetime.timedelta(seconds=config.training.timeout_s)
    topology = planning_topology(config.planner, env, timeout)
    planner = EmbeddingShardingPlanner(
        topology,
        # [embedding.placements] pins those tables; the planner places the others.
        constraints={
            name: ParameterConstraints(placements=(placement,))
            for name, placement in config.embedding.placements.items()
        },
        batch_size=config.data.batch_size,
        default_optimizer=config.embedding.optimizer,
    )
    plan = plan_collectively(
        planner, {"embedding_bags": list(config.embedding.tables)}, timeout=timeout
    )
    if env.device.type == "cpu":  # on CUDA the planner fitted the plan to the GPUs' memory
        dense = [m for name, m in model.named_children() if name != "embedding_bags"]
        check_host_memory(
            plan["embedding_bags"],
            config.embedding.tables,
            config.embedding.optimizer,
            nn.ModuleList(dense),
            host_ranks(env.rank, env.local_world_size, env.world_size),
            timeout,
        )
    return DistributedModelParallel(model, plan=plan, device=env.device, timeout=timeout)


def planning_topology(values: dict[str, Any], env: RunEnv, timeout: datetime.timedelta) -> Topology:
    """The planner's topology: ``[planner]``'s fields over the run's own device.

    Without ``device`` in ``[planner]``, the topology follows the device this run trains on.
    On CUDA the GPU's free memory and the host's memory for UVM are measured on every rank
    and the least is kept (`shared_topology`), so the planner can place tables in UVM when
    HBM runs short; fields given in ``[planner]`` win. On CPU, ``[planner]`` alone (the
    Topology defaults for what it leaves out). ``device = "cpu"`` or ``"cuda"`` describes a
    machine explicitly, measured nothing.
    """
    from recopt.sharding.planner import training_topology
    from recopt.sharding.planner.topology import topology_from_dict

    given = topology_from_dict(values, "[planner]", world_size=env.world_size)
    if "device" in values or env.device.type != "cuda":
        return given
    measured = training_topology(env.world_size, env.local_world_size, env.device, timeout=timeout)
    return measured.replace(**{name: getattr(given, name) for name in values})


def build_optimizer(model: nn.Module, config: TrainingConfig) -> KeyedOptimizer:
    """Fused sparse + torch dense optimizer, each under its own warmup, all under clipping."""
    sparse: KeyedOptimizer = (
        model.fused_optimizer if is_fused(model) else CombinedOptimizer(fused_optimizers(model))
    )
    # The model-parallel wrapper is itself "fused" (it has .fused_optimizer): split the model
    # it wraps, whose names are the wrapper's parameter names (no DDP prefix).
    _, dense_params = split_fused_parameters(getattr(model, "plain_module", model))
    dense_params = {n: p for n, p in dense_params.items() if p.requires_grad}
    dense = KeyedOptimizerWrapper(dense_params, _dense_factory(config))
    stages = config.warmup.stages
    parts: list[tuple[str, KeyedOptimizer]] = [("sparse", sparse), ("dense", dense)]
    if stages:
        # Each side keeps its own base LR; the warmup multiplies it.
        parts = [
            ("sparse", WarmupOptimizer(sparse, stages, lr=config.embedding.optimizer.lr)),
            ("dense", WarmupOptimizer(dense, stages, lr=config.dense_optimizer.lr)),
        ]
    clip = config.clipping
    return GradientClippingOptimizer(
        CombinedOptimizer(parts),
        clipping=clip.clipping,
        max_gradient=clip.max_gradient,
        norm_type=clip.norm_type,
        skip_nonfinite=True,  # a NaN/inf global norm skips the dense step on every rank
        timeout=datetime.timedelta(seconds=config.training.timeout_s),
    )


def _dense_factory(config: TrainingConfig) -> Any:
    opt = config.dense_optimizer

    def factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        if opt.name == "adagrad":
            return torch.optim.Adagrad(
                params, lr=opt.lr, eps=opt.eps, weight_decay=opt.weight_decay
            )
        if opt.name == "adam":
            return torch.optim.Adam(
                params, lr=opt.lr, eps=opt.eps, betas=opt.betas, weight_decay=opt.weight_decay
            )
        return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)

    return factory


def build_data(
    config: TrainingConfig, env: RunEnv, split: str, clock: int = 0
) -> BatchIterator | None:
    """This rank's share of the training (endless) or validation (``val_batches``) stream of
    ``[data] source`` (dlrm_data.py), or None when the source has no data for ``split``.
    ``clock``: global batches trained so far (a drifting synthetic validation follows it)."""
    return data_source(config.data.source)(config, env.rank, env.world_size, split, clock=clock)
