"""What both embedding twins (FusedEmbeddingBagCollection, ShardedEmbeddingBagCollection)
share about their fused optimizers: which optimizer each table runs, the param group of each
optimizer, and pushing a learning rate changed in a param group to the group's kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.kernels.contract import Kernel
from recopt.modules.config import EmbeddingBagConfig


def resolve_table_optimizers(
    tables: Sequence[EmbeddingBagConfig],
    default: FusedOptimizerConfig | None,
    overrides: Mapping[str, FusedOptimizerConfig] | None,
    planned: Mapping[str, FusedOptimizerConfig | None] | None = None,
) -> dict[str, FusedOptimizerConfig]:
    """The fused optimizer of every table: the plan's, else the table's override, else the default.

    Args:
        tables: the collection's tables.
        default: the collection's optimizer (``None``: `FusedOptimizerConfig()`).
        overrides: table name -> optimizer.
        planned: table name -> the sharding plan's optimizer for it, if any.

    Returns:
        Table name -> optimizer, in table order.

    Raises:
        ValueError: an override names a table the collection does not have.
    """
    fallback = default if default is not None else FusedOptimizerConfig()
    given = dict(overrides or {})
    unknown = sorted(set(given) - {t.name for t in tables})
    if unknown:
        raise ValueError(
            f"table_optimizers names unknown tables {unknown}; the tables are "
            f"{[t.name for t in tables]}"
        )
    plan = planned or {}
    return {t.name: plan.get(t.name) or given.get(t.name, fallback) for t in tables}


def kernels_backend(kernels: Sequence[Kernel], requested: Backend) -> str:
    """The backend that runs a param group's kernels: ``"fbgemm"`` or ``"recopt"``.

    The requested value (``"auto"`` unless forced) when there is no kernel (a rank that holds
    none of the group's tables) or the kernels run on different backends.
    """
    backends = {k.backend for k in kernels}
    return str(backends.pop().value) if len(backends) == 1 else str(requested.value)


def make_param_group(
    optimizer: FusedOptimizerConfig, params: list[torch.Tensor], kernels: Sequence[Kernel]
) -> dict[str, Any]:
    """A torch-style param group: the params and the optimizer's hyperparameters.

    ``optimizer`` holds the optimizer's name, ``backend`` the one its kernels run on, and
    ``backend_reason`` / ``backend_seconds`` how that backend was chosen (`create_kernel`'s
    decision: explicit, pinned, cached, measured with the probe's times, or shared by rank 0);
    ``None`` / empty when the kernels were decided differently or built directly.
    """
    hyper = dataclasses.asdict(optimizer)
    hyper.pop("d")  # an alias, folded into clip_threshold at construction
    hyper["optimizer"] = hyper.pop("name")
    hyper["backend"] = kernels_backend(kernels, optimizer.backend)
    decisions = [k.backend_decision for k in kernels]
    same = bool(decisions) and all(d == decisions[0] for d in decisions)
    decision = decisions[0] if same else None
    hyper["backend_reason"] = decision.reason if decision is not None else None
    hyper["backend_seconds"] = dict(decision.seconds) if decision is not None else {}
    return {"params": params, **hyper}


def optimizer_from_param_group(group: Mapping[str, Any]) -> FusedOptimizerConfig:
    """The fused optimizer a `make_param_group` describes (its ``lr`` as the group has it now).

    The backend is left to ``auto``: the kernels that will run it may differ (e.g. shards).
    """
    fields = {f.name for f in dataclasses.fields(FusedOptimizerConfig)} - {"name", "d", "backend"}
    values = {k: group[k] for k in fields if k in group}
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    return FusedOptimizerConfig(name=group["optimizer"], backend=Backend.AUTO, **values)


class LearningRateSync:
    """Pushes a param group's ``lr`` to its kernels when it changed since it was last pushed.

    The comparison is with the value last set, not the kernel's (fbgemm keeps float32).

    Args:
        kernels_by_group: for each param group, the kernels that run its tables.
        initial: for each param group, the learning rate its kernels were built with.
    """

    def __init__(
        self, kernels_by_group: Sequence[Sequence[Kernel]], initial: Sequence[float]
    ) -> None:
        self._kernels = [list(ks) for ks in kernels_by_group]
        self._applied = list(initial)

    def apply(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        """Set each changed ``lr`` on the group's kernels (called before each forward)."""
        for i, group in enumerate(param_groups):
            lr = float(group["lr"])
            if lr != self._applied[i]:
                for kernel in self._kernels[i]:
                    kernel.set_learning_rate(lr)
                self._applied[i] = lr
