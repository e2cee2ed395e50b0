"""WarmupOptimizer: sets the learning rate of a KeyedOptimizer from a staged schedule.

Each stage applies a policy (linear warmup, constant, polynomial / step decay, inverse square
root, cosine annealing with warm restarts) until its ``max_iters``. The schedule position is
saved in the state dict under its own key, whatever optimizer is wrapped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from enum import Enum, unique
from typing import Any

import torch

from recopt.optim._state import check_value, copy_value
from recopt.optim.keyed import KeyedOptimizer, OptimizerWrapper

logger = logging.getLogger(__name__)


@unique
class WarmupPolicy(Enum):
    """How a stage turns the iteration into an LR multiplier (see `lr_multiplier`)."""

    NONE = "none"
    LINEAR = "linear"
    CONSTANT = "constant"
    POLY = "poly"
    STEP = "step"
    INVSQRT = "inv_sqrt"
    COSINE_ANNEALING_WARM_RESTARTS = "cosine_annealing_warm_restarts"


@dataclasses.dataclass(frozen=True)
class WarmupStage:
    """One stage of a warmup schedule; it lasts while the iteration is ``<= max_iters``.

    Args:
        policy: the multiplier formula.
        max_iters: last iteration (global, not stage-relative) of this stage.
        value: LINEAR start multiplier, CONSTANT multiplier, POLY exponent, STEP decay
            factor, or COSINE_ANNEALING_WARM_RESTARTS minimum multiplier (eta_min / lr).
        lr_scale: every multiplier of the stage is scaled by this.
        decay_iters: POLY denominator (default ``max_iters``); STEP interval (default 1).
        sgdr_period: COSINE_ANNEALING_WARM_RESTARTS period between restarts (T_0).

    Raises:
        ValueError: a policy that is not a WarmupPolicy, ``max_iters`` or ``sgdr_period``
            below 1, or a non-finite ``value`` / ``lr_scale``.
    """

    policy: WarmupPolicy = WarmupPolicy.LINEAR
    max_iters: int = 1
    value: float = 1.0
    lr_scale: float = 1.0
    decay_iters: int = -1
    sgdr_period: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.policy, WarmupPolicy):
            raise ValueError(f"WarmupStage.policy must be a WarmupPolicy, got {self.policy!r}")
        if self.max_iters < 1:
            raise ValueError(f"WarmupStage.max_iters must be >= 1, got {self.max_iters}")
        if self.sgdr_period < 1:
            raise ValueError(f"WarmupStage.sgdr_period must be >= 1, got {self.sgdr_period}")
        for field in ("value", "lr_scale"):
            number = getattr(self, field)
            # every policy reads them as a multiplier, an exponent or a factor: a negative one
            # gives a negative lr (a step up the gradient) or a pole
            if not (math.isfinite(number) and number >= 0):
                raise ValueError(f"WarmupStage.{field} must be finite and >= 0, got {number}")


def lr_multiplier(stage: WarmupStage, iteration: int) -> float:
    """The LR multiplier of ``stage`` at global ``iteration`` (decay_iters already resolved).

    LINEAR ``value + (1 - value) * it / max_iters``; CONSTANT ``value``; POLY
    ``max(0, 1 - it / decay_iters) ** value``; STEP ``value ** (it // decay_iters)``;
    INVSQRT ``1 / sqrt(max(it, 1))``; COSINE_ANNEALING_WARM_RESTARTS
    ``value + (1 - value) * (1 + cos(pi * (it % sgdr_period) / sgdr_period)) / 2``; NONE 1.
    The result is multiplied by ``lr_scale``.
    """
    policy, it = stage.policy, iteration
    if policy == WarmupPolicy.LINEAR:
        multiplier = stage.value + (1.0 - stage.value) * it / stage.max_iters
    elif policy == WarmupPolicy.CONSTANT:
        multiplier = stage.value
    elif policy == WarmupPolicy.POLY:
        # Clamped: past decay_iters the reference raises a negative base to a real power.
        multiplier = max(0.0, 1.0 - it / stage.decay_iters) ** stage.value
    elif policy == WarmupPolicy.STEP:
        multiplier = stage.value ** (it // stage.decay_iters)
    elif policy == WarmupPolicy.INVSQRT:
        multiplier = 1.0 / math.sqrt(max(it, 1))  # the reference divides by zero at it = 0
    elif policy == WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS:
        phase = (it % stage.sgdr_period) / stage.sgdr_period
        multiplier = stage.value + (1.0 - stage.value) * 0.5 * (1.0 + math.cos(math.pi * phase))
    else:
        multiplier = 1.0
    return multiplier * stage.lr_scale


def resolve_stages(stages: Sequence[WarmupStage]) -> list[WarmupStage]:
    """Validate ``stages`` and return copies with defaults filled, plus a final NONE stage.

    Raises:
        ValueError: a stage that is not a WarmupStage, or ``max_iters`` not strictly
            increasing (naming both stages).
    """
    resolved: list[WarmupStage] = []
    previous = 0
    for i, stage in enumerate(stages):
        if not isinstance(stage, WarmupStage):
            raise ValueError(f"stages[{i}] must be a WarmupStage, got {type(stage).__name__}")
        if stage.max_iters <= previous:
            raise ValueError(
                f"stages[{i}].max_iters = {stage.max_iters} must be greater than the previous "
                f"stage's max_iters = {previous}; max_iters are global, strictly increasing"
            )
        previous = stage.max_iters
        decay = stage.decay_iters
        if decay <= 0:
            decay = 1 if stage.policy == WarmupPolicy.STEP else stage.max_iters
        resolved.append(dataclasses.replace(stage, decay_iters=decay))
    resolved.append(WarmupStage(policy=WarmupPolicy.NONE, max_iters=sys.maxsize))
    return resolved


class _WarmupState(MutableMapping[Any, Any]):
    """The wrapped optimizer's state (live), plus the schedule position under ``param_name``
    (read-only), as ``state_dict()["state"]`` shows it and TorchRec's ``.state`` holds it."""

    def __init__(self, owner: WarmupOptimizer) -> None:
        self._owner = owner

    def _is_position(self, key: Any) -> bool:
        return isinstance(key, str) and key == self._owner._param_name

    def __getitem__(self, key: Any) -> Any:
        if self._is_position(key):
            return {"warmup": self._owner._position}
        inner = self._owner.wrapped.state
        if key in inner:  # never through a defaultdict's __getitem__, which would add key
            return inner[key]
        raise KeyError(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._is_position(key):
            raise ValueError(
                f"state[{key!r}] is the warmup position; load it with load_state_dict()"
            )
        self._owner.wrapped.state[key] = value

    def __delitem__(self, key: Any) -> None:
        if self._is_position(key):
            raise ValueError(f"state[{key!r}] is the warmup position; it cannot be removed")
        del self._owner.wrapped.state[key]

    def __iter__(self) -> Iterator[Any]:
        yield from self._owner.wrapped.state
        yield self._owner._param_name

    def __len__(self) -> int:
        return len(self._owner.wrapped.state) + 1


class WarmupOptimizer(OptimizerWrapper):
    """Sets every param group's LR to ``lr * multiplier(stage, iteration)`` after each step.

    The position ``[iteration, stage]`` is saved in ``state_dict()["state"][param_name]``
    as ``{"warmup": LongTensor[2]}`` (the reference's layout; ``.state[param_name]`` shows it
    too, the wrapped optimizer's entries being live) and restored by
    ``load_state_dict``, also when the wrapped optimizer is a CombinedOptimizer (where the
    reference's fake parameter is silently lost). The caller's stages are never modified.

    ``lr`` is the base learning rate of the schedule and *replaces* whatever LR the wrapped
    optimizer was configured with (e.g. a fused embedding optimizer's ``lr``): from
    construction on, every group's LR is ``lr * multiplier``. Pass the wrapped optimizer's
    own LR as ``lr`` to schedule around it; a UserWarning is emitted when the two differ.

    Args:
        optimizer: the KeyedOptimizer whose LR is scheduled.
        stages: the stages, with strictly increasing ``max_iters``; after the last one the
            multiplier is 1.
        lr: the base learning rate; it overrides the wrapped optimizer's configured LR.
        lr_param: the param group key to set.
        param_name: the state dict key of the warmup position.

    Raises:
        ValueError: bad stages, or ``param_name`` clashing with a key of ``optimizer``.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        stages: Sequence[WarmupStage],
        lr: float = 0.1,
        lr_param: str = "lr",
        param_name: str = "__warmup",
    ) -> None:
        super().__init__(optimizer)
        self._stages = resolve_stages(stages)
        if param_name in optimizer._state_keys():
            raise ValueError(
                f"param_name '{param_name}' is already a key of the wrapped optimizer; "
                "choose another param_name"
            )
        self._lr = lr
        self._lr_param = lr_param
        self._param_name = param_name
        self._warn_if_lr_replaced()
        self._position = torch.zeros(2, dtype=torch.long)  # [iteration, stage index]
        self._set_lr()  # a fused optimizer runs backward (and its update) before step()

    @property  # type: ignore[override]
    def state(self) -> MutableMapping[Any, Any]:
        """The wrapped optimizer's state (live) and, under ``param_name``, the position."""
        return _WarmupState(self)

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError(f"set state on the wrapped optimizer ({type(self.wrapped).__name__})")

    def _warn_if_lr_replaced(self) -> None:
        configured = sorted(
            {float(g[self._lr_param]) for g in self.param_groups if self._lr_param in g}
        )
        if configured and configured != [float(self._lr)]:
            warnings.warn(
                f"WarmupOptimizer(lr={self._lr}) replaces the wrapped optimizer's configured "
                f"{self._lr_param} {', '.join(map(str, configured))}: the schedule sets every "
                f"group's {self._lr_param} to lr * multiplier. Pass lr equal to the wrapped "
                "optimizer's to keep it as the base",
                UserWarning,
                stacklevel=3,
            )

    @property
    def iteration(self) -> int:
        """Steps taken so far."""
        return int(self._position[0])

    @property
    def stage_index(self) -> int:
        """Index of the current stage (``len(stages)`` once past the last one)."""
        return int(self._position[1])

    @property
    def stages(self) -> list[WarmupStage]:
        """The resolved stages, ending with the implicit NONE stage."""
        return list(self._stages)

    def _set_lr(self) -> None:
        lr = self._lr * lr_multiplier(self._stages[self.stage_index], self.iteration)
        for group in self.param_groups:
            group[self._lr_param] = lr

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the wrapped optimizer, then advance the schedule and set the next LR."""
        loss = self._optimizer.step(closure)
        iteration, stage = self.iteration + 1, self.stage_index
        if iteration > self._stages[stage].max_iters and stage + 1 < len(self._stages):
            stage += 1
            logger.info(
                "warmup: iteration %d enters stage %d %s", iteration, stage, self._stages[stage]
            )
        self._position[0], self._position[1] = iteration, stage
        self._set_lr()
        return loss

    def post_load_state_dict(self) -> None:
        """Apply the loaded schedule position to the learning rate (after the wrapped
        optimizer's own ``post_load_state_dict``)."""
        super().post_load_state_dict()
        logger.info("warmup: restored to iteration %d, stage %d", self.iteration, self.stage_index)
        self._set_lr()

    def _state_keys(self) -> list[str]:
        return [*self._optimizer._state_keys(), self._param_name]

    def _build_state_dict(self) -> dict[str, Any]:
        state_dict = self._optimizer.state_dict()
        state_dict["state"][self._param_name] = {"warmup": self._position}
        return state_dict

    def _split(self, state_dict: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
        if not isinstance(state, Mapping) or self._param_name not in state:
            raise ValueError(
                f"state_dict['state'] has no warmup position '{self._param_name}'; load a "
                "state_dict saved by a WarmupOptimizer with the same param_name"
            )
        own = state[self._param_name]
        check_value(f"warmup state '{self._param_name}'", {"warmup": self._position}, own)
        iteration, stage = (int(v) for v in own["warmup"])
        if iteration < 0:
            raise ValueError(
                f"warmup state '{self._param_name}': iteration {iteration} is negative; load a "
                "state_dict saved by a WarmupOptimizer"
            )
        if not 0 <= stage < len(self._stages):
            raise ValueError(
                f"warmup state '{self._param_name}': stage {stage} does not exist (this "
                f"optimizer has {len(self._stages)} stages including the final one)"
            )
        inner = {k: v for k, v in state.items() if k != self._param_name}
        return own, {**state_dict, "state": inner}

    def _check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        _, inner = self._split(state_dict)
        self._optimizer._check_state_dict(inner)

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        own, inner = self._split(state_dict)
        super()._load(inner)
        copy_value({"warmup": self._position}, own)
