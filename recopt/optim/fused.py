"""Optimizers whose update runs inside the backward pass, and the modules that own them.

A fused module (e.g. FusedEmbeddingBagCollection) updates its weights in backward and
exposes the update's state as a KeyedOptimizer; `split_fused_parameters` tells a trainer
which parameters still need a regular optimizer.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from recopt.optim.keyed import KeyedOptimizer


class FusedOptimizer(KeyedOptimizer):
    """A KeyedOptimizer whose update happens in backward; ``step()`` applies no update.

    Its state exists from construction (the kernel allocates it), so ``init_state()`` has
    nothing to do. Fused tables never accumulate ``.grad``, so ``zero_grad()`` neither.

    Attributes:
        optional_state: state names (after ``<table>.``) that a loaded state dict may lack or
            hold in excess, so that state moves between configurations that keep them and
            ones that do not: a lacking value loads as zeros, an excess one is dropped. The
            embedding twins name their ``rounding_step`` pass counters here.
    """

    optional_state: tuple[str, ...] = ()
    # Param-group keys that say how this process runs the kernel, not what it computes: a
    # load keeps the live ones (another machine's AUTO may have chosen another backend).
    run_keys: tuple[str, ...] = ("backend", "backend_reason", "backend_seconds")

    def _check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state_dict = self._with_optional_state(state_dict)
        super()._check_state_dict(state_dict)
        if self._save_param_groups:
            self._check_fixed_groups(state_dict)

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        super()._load(self._with_live_run_keys(self._with_optional_state(state_dict)))

    def _check_fixed_groups(self, state_dict: Mapping[str, Any]) -> None:
        """A loaded param group may change ``lr`` (the kernel reads it every step) and add
        keys (a scheduler's ``initial_lr``); its other hyperparameters were built into the
        kernel, so a different value is refused rather than shown but not applied."""
        for i, (group, new) in enumerate(self._match_groups(state_dict)):
            for key, value in new.items():
                if key in ("params", "lr", *self.run_keys) or key not in group:
                    continue
                if _comparable(value) != _comparable(group[key]):
                    raise ValueError(
                        f"param group {i}: '{key}' is {value!r} in the state_dict but "
                        f"{group[key]!r} here; a fused optimizer's hyperparameters other than "
                        "lr are built into its kernel: build the module with that optimizer, "
                        "or load without param groups (save_param_groups(False))"
                    )

    def _with_live_run_keys(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state_dict`` with its groups' `run_keys` replaced by the live groups' (checked)."""
        if not self._save_param_groups:
            return state_dict
        groups = [
            {**new, **{k: group[k] for k in self.run_keys if k in group}}
            for group, new in self._match_groups(state_dict)
        ]
        return {**state_dict, "param_groups": groups}

    def _with_optional_state(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state_dict`` with its optional state matched to this optimizer's (see the class)."""
        if not self.optional_state or not isinstance(state_dict, Mapping):
            return state_dict
        new_state = state_dict.get("state")
        if not isinstance(new_state, Mapping):
            return state_dict  # malformed: the strict check names the problem
        adjusted = dict(new_state)
        for name, value in new_state.items():
            param = self.params.get(name)
            if param is None or param not in self.state or not isinstance(value, Mapping):
                continue
            adjusted[name] = self._match_optional(self.state[param], value)
        return {**state_dict, "state": adjusted}

    def _match_optional(self, live: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
        def optional(key: object) -> bool:
            return isinstance(key, str) and key.rsplit(".", 1)[-1] in self.optional_state

        matched = {k: v for k, v in new.items() if k in live or not optional(k)}
        for key, value in live.items():
            if key not in matched and optional(key) and _is_scalar_tensor(value):
                matched[key] = torch.zeros_like(value)
        return matched

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Run ``closure`` if given (with grad enabled); the update already happened."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to reset: fused tables keep no gradient."""

    def init_state(self, sparse_grad_parameter_names: Iterable[str] | None = None) -> None:
        """No-op: fused state is allocated eagerly by the kernel."""

    def __call__(self) -> FusedOptimizer:
        """Returns itself: TorchRec code calls ``module.fused_optimizer()`` (a method there),
        recopt code reads ``module.fused_optimizer`` (a property); both work."""
        return self


def _comparable(value: object) -> object:
    """``value`` with lists as tuples (a saved ``betas`` may come back as either)."""
    if isinstance(value, list | tuple):
        return tuple(_comparable(v) for v in value)
    return value


def _is_scalar_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


class FusedOptimizerModule(abc.ABC):
    """A module that updates its own weights during backward."""

    @property
    @abc.abstractmethod
    def fused_optimizer(self) -> KeyedOptimizer:
        """The optimizer state and hyperparameters of the in-backward update."""


class EmptyFusedOptimizer(FusedOptimizer):
    """A FusedOptimizer over no parameters (a placeholder where a module has none)."""

    def __init__(self) -> None:
        super().__init__({}, {}, [])


def is_fused(module: nn.Module) -> bool:
    """Whether ``module`` updates its own weights in backward: the one rule recopt uses.

    True for a `FusedOptimizerModule` (the embedding twins) and for any module whose class
    exposes a ``fused_optimizer`` property (``DistributedModelParallel``, whose whole model is
    then fused, and duck-typed twins).
    """
    return isinstance(module, FusedOptimizerModule) or isinstance(
        getattr(type(module), "fused_optimizer", None), property
    )


def split_fused_parameters(
    model: nn.Module,
) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """Split a model's parameters into those updated in backward and the rest.

    A parameter is fused when it belongs to a submodule that `is_fused`. A parameter shared between
    a fused and a regular module counts as fused (its update already happens in backward).

    Args:
        model: the model.

    Returns:
        ``(fused, other)``: fully qualified name -> parameter, each parameter once, in
        ``model.named_parameters()`` order.
    """
    fused_ids: set[int] = set()
    for _, module in model.named_modules():
        if is_fused(module):
            fused_ids.update(id(p) for p in module.parameters())
    fused: dict[str, nn.Parameter] = {}
    other: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters():
        (fused if id(param) in fused_ids else other)[name] = param
    return fused, other


def fused_optimizers(model: nn.Module) -> list[tuple[str, KeyedOptimizer]]:
    """The ``(module name, fused_optimizer)`` of each outermost fused submodule of ``model``.

    Args:
        model: the model.

    Returns:
        Pairs ready for ``CombinedOptimizer``; a fused module nested in another is skipped.
    """
    found: list[tuple[str, KeyedOptimizer]] = []
    for name, module in model.named_modules():
        inside = any(outer == "" or name.startswith(f"{outer}.") for outer, _ in found)
        if is_fused(module) and not inside:
            found.append((name, module.fused_optimizer))
    return found


def in_backward_optimizer_filter(
    named_parameters: Iterable[tuple[str, torch.Tensor]], include: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters that do not (default) or do (``include``) have an optimizer applied in
    backward by ``torch.distributed.optim._apply_optimizer_in_backward``.

    The default is TorchRec's: ``dict(in_backward_optimizer_filter(model.named_parameters()))``
    is what the dense optimizer takes, the embedding tables left to their own optimizer.

    Args:
        named_parameters: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``.
        include: keep the in-backward parameters (True) or the others (False, the default).
    """
    for name, param in named_parameters:
        if hasattr(param, "_in_backward_optimizers") == include:
            yield name, param
