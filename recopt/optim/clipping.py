"""GradientClippingOptimizer: clip gradients by global norm or by value before a step.

With sharded parameters the norm is the true global norm: each process group's partial sum
of |g|^p is all-reduced (max for p = inf) and replicated parameters are counted once. Every
rank joins every group's collective, with or without gradients, so no rank can hang.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Callable, Mapping
from enum import Enum, unique
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recopt.optim._state import describe
from recopt.optim.combined import CombinedOptimizer
from recopt.optim.fused import FusedOptimizer
from recopt.optim.keyed import KeyedOptimizer, OptimizerWrapper, evaluated

logger = logging.getLogger(__name__)

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: keeps the coefficient finite at norm 0


@unique
class GradientClipping(Enum):
    """NONE: no clipping; NORM: scale all gradients to a global norm; VALUE: clamp each."""

    NONE = "none"
    NORM = "norm"
    VALUE = "value"


def _local_grad_holders(param: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` holds this rank's part of ``param``'s gradient."""
    if isinstance(param, ShardedTensor):
        return [shard.tensor for shard in param.local_shards()]
    return [param]


def _local_grads(param: torch.Tensor) -> list[torch.Tensor]:
    grads = []
    for holder in _local_grad_holders(param):
        if holder.grad is None:
            continue
        if holder.grad.is_sparse:
            # Duplicate indices must be summed before norms or clamps see the values.
            holder.grad = holder.grad.coalesce()
            grads.append(holder.grad._values())
        else:
            grads.append(holder.grad)
    return grads


def _fused_param_ids(optimizer: KeyedOptimizer) -> set[int]:
    """Parameters updated in backward by a FusedOptimizer anywhere under ``optimizer``."""
    if isinstance(optimizer, FusedOptimizer):
        return {id(p) for p in optimizer.params.values()}
    if isinstance(optimizer, OptimizerWrapper):
        return _fused_param_ids(optimizer.wrapped)
    if isinstance(optimizer, CombinedOptimizer):
        return {i for _, child in optimizer.optimizers for i in _fused_param_ids(child)}
    return set()


def _partial(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Sum of |g|^p over ``grads`` (max |g| for p = inf), as a float64 CPU scalar.

    Norms are taken in the gradient's dtype (at least float32, never a float64 copy of a
    large gradient) and combined per device, so there is one device-to-host copy per device.
    """
    is_max = math.isinf(norm_type)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel() == 0:
            continue
        g = g.detach()
        if is_max:
            part = g.abs().max().to(torch.float64)
        else:
            dtype = torch.promote_types(g.dtype, torch.float32)
            norm = torch.linalg.vector_norm(g, norm_type, dtype=dtype)
            part = norm.to(torch.float64) ** norm_type
        by_device.setdefault(part.device, []).append(part)
    total = torch.zeros((), dtype=torch.float64)
    for parts in by_device.values():
        stacked = torch.stack(parts)
        value = (stacked.max() if is_max else stacked.sum()).cpu()
        total = torch.maximum(total, value) if is_max else total + value
    return total


class GradientClippingOptimizer(OptimizerWrapper):
    """Clips gradients, then steps the wrapped optimizer.

    Args:
        optimizer: the KeyedOptimizer to step.
        clipping: NONE, NORM (scale every gradient by ``max_gradient / (norm + 1e-6)``
            when the global norm exceeds ``max_gradient``) or VALUE (clamp to
            ``[-max_gradient, max_gradient]``).
        max_gradient: the norm or value limit, >= 0.
        norm_type: p of the norm, > 0, ``float("inf")`` or ``"inf"`` for the max norm.
        split_params: parameter name -> the process group it is split across (``None`` for
            the default group). Each rank holds a disjoint piece of such a parameter; its
            gradient pieces are summed across the group. ShardedTensor parameters are split
            across their own group without being listed. Every other parameter is
            replicated and counted once. Every rank must register the same process groups.
            Parameters of FusedOptimizers (updated in backward, e.g. fused embedding tables)
            are neither counted nor clipped, and cost no collective.
        skip_nonfinite: when the global norm is inf or nan, skip the step, log a warning and
            count it in ``num_skipped_steps`` (all ranks agree: the norm is global).
        timeout: limit of each norm all-reduce.

    Raises:
        ValueError: a bad ``clipping``, ``max_gradient`` or ``norm_type``, or a
            ``split_params`` name that is not a parameter of ``optimizer``.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        clipping: GradientClipping = GradientClipping.NONE,
        max_gradient: float = 0.1,
        norm_type: float | str = 2.0,
        split_params: Mapping[str, dist.ProcessGroup | None] | None = None,
        skip_nonfinite: bool = False,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
    ) -> None:
        super().__init__(optimizer)
        if not isinstance(clipping, GradientClipping):
            raise ValueError(f"clipping must be a GradientClipping, got {clipping!r}")
        if not (max_gradient >= 0 and math.isfinite(max_gradient)):
            raise ValueError(f"max_gradient must be finite and >= 0, got {max_gradient}")
        p = float(norm_type)
        if not p > 0:
            raise ValueError(f"norm_type must be > 0 (or 'inf'), got {norm_type!r}")
        split = dict(split_params or {})
        unknown = set(split) - set(optimizer.params)
        if unknown:
            raise ValueError(
                f"split_params names {describe(unknown)}, which are not parameters of the "
                f"optimizer; known: {describe(optimizer.params)}"
            )
        self._clipping = clipping
        self._max_gradient = float(max_gradient)
        self._norm_type = p
        self._split = split
        self._skip_nonfinite = skip_nonfinite
        self._timeout = timeout
        self.num_skipped_steps = 0
        self.last_norm: torch.Tensor | None = None

    def _groups_of_params(self) -> tuple[list[torch.Tensor], dict[tuple[int, ...], Any]]:
        """Replicated local grads, and per split group (keyed by its ranks): group, grads."""
        replicated: list[torch.Tensor] = []
        split: dict[tuple[int, ...], Any] = {}
        for name, param in self._clipped_params():
            if isinstance(param, ShardedTensor):
                group: Any = param._process_group
            elif name in self._split:
                group = self._split[name] or dist.group.WORLD
            else:
                replicated.extend(_local_grads(param))
                continue
            if not dist.is_initialized():
                raise ValueError(
                    f"parameter '{name}' is split across a process group but torch.distributed "
                    "is not initialised; call init_process_group first"
                )
            # Ranks, not group objects, identify a group the same way on every rank.
            key = tuple(dist.get_process_group_ranks(group))
            split.setdefault(key, (group, []))[1].extend(_local_grads(param))
        return replicated, split

    def _reduce(self, value: torch.Tensor, group: Any) -> torch.Tensor:
        from recopt import comm

        op = dist.ReduceOp.MAX if math.isinf(self._norm_type) else dist.ReduceOp.SUM
        # comm puts the value on a device the group serves (the GPU for NCCL alone).
        return comm.all_reduce(value.clone(), group, op, self._timeout).cpu()

    def global_norm(self) -> torch.Tensor:
        """The p-norm of all gradients across ranks (a collective on every split group).

        Returns:
            A float64 CPU scalar tensor.
        """
        replicated, split = self._groups_of_params()
        total = _partial(replicated, self._norm_type)
        for key in sorted(split):
            group, grads = split[key]
            reduced = self._reduce(_partial(grads, self._norm_type), group)
            total = (
                torch.maximum(total, reduced) if math.isinf(self._norm_type) else total + reduced
            )
        return total if math.isinf(self._norm_type) else total ** (1.0 / self._norm_type)

    def _clipped_params(self) -> list[tuple[str, torch.Tensor]]:
        fused = _fused_param_ids(self._optimizer)
        return [(n, p) for n, p in self._optimizer.params.items() if id(p) not in fused]

    def _all_local_grads(self) -> list[torch.Tensor]:
        return [g for _, p in self._clipped_params() for g in _local_grads(p)]

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Evaluate ``closure`` (if any), clip, then step the wrapped optimizer.

        The closure runs once, before clipping, since clipping needs its gradients; the
        wrapped optimizer's ``step`` gets a closure returning that loss (``None`` when no
        closure was given), so gradients are never recomputed behind the clipping.
        Optimizers that re-evaluate the closure several times (LBFGS) are not supported.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._clipping == GradientClipping.NORM or self._skip_nonfinite:
            norm = self.global_norm()
            self.last_norm = norm
            if self._skip_nonfinite and not bool(torch.isfinite(norm)):
                self.num_skipped_steps += 1
                logger.warning(
                    "gradient norm is %s: step skipped (%d skipped so far)",
                    float(norm),
                    self.num_skipped_steps,
                )
                return loss
        if self._clipping == GradientClipping.NORM:
            coef = torch.clamp(self._max_gradient / (norm + _EPS), max=1.0)
            # below the limit, gradients stay bit-identical; a NaN norm makes them NaN, as
            # torch.nn.utils.clip_grad_norm_ does (skip_nonfinite skipped such a step above)
            if not bool(coef >= 1.0):
                for g in self._all_local_grads():
                    g.mul_(coef.to(g.device, g.dtype))
        elif self._clipping == GradientClipping.VALUE:
            for g in self._all_local_grads():
                g.clamp_(-self._max_gradient, self._max_gradient)
        self._optimizer.step(None if closure is None else evaluated(loss))
        return loss
