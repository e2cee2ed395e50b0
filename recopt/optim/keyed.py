"""KeyedOptimizer: an optimizer whose state_dict is keyed by parameter name, not by index.

Names make checkpoints robust to parameter order and let sharded state (ShardedTensor) be
loaded in place; loading is strict and all-or-nothing. Also here: KeyedOptimizerWrapper
(any torch.optim optimizer as a KeyedOptimizer) and OptimizerWrapper (base of wrappers).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recopt.optim._state import (
    check_value,
    copy_value,
    describe,
    export_value,
    init_optimizer_hooks,
    saved_param_groups,
    top_level_state,
    validate_structure,
    zero_grad_step,
)

# Keys of a state_dict group that a torch optimizer or an LR scheduler may add on its own.
_OPTIONAL_GROUP_KEYS = frozenset({"initial_lr", "param_names"})


def evaluated(loss: Any) -> Callable[[], Any]:
    """A closure returning ``loss``, for an inner ``step`` after the wrapper ran the closure.

    Wrappers that must see gradients before stepping (clipping) or step several children
    (CombinedOptimizer) evaluate the user's closure once; each inner ``step(closure)`` still
    receives a closure, as torch's API defines it, that hands back that loss.
    """
    return lambda: loss


def unhooked_step(optimizer: torch.optim.Optimizer) -> Any:
    """Run ``optimizer``'s own step without step hooks or an LR scheduler's instance patch."""
    step = type(optimizer).step
    raw = getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step
    return raw(optimizer, None)  # positional: an inner ``step(self, closure)`` needs one


class KeyedOptimizer(torch.optim.Optimizer):
    """An optimizer over named parameters whose ``state_dict()`` is keyed by name.

    Unlike ``torch.optim.Optimizer``, ``load_state_dict`` copies into the existing state
    tensors (ShardedTensor state shard by shard), so state must exist before loading: call
    ``init_state()`` on a fresh optimizer. Loading is strict: state keys, shapes and dtypes
    must match and nothing is changed unless everything matches. Param groups are saved only
    after ``save_param_groups(True)``, with their params given by name.

    Args:
        params: parameter name -> tensor (or ShardedTensor).
        state: parameter tensor -> its state (usually a dict of tensors / Python scalars).
            Kept by reference, so a wrapped optimizer's state stays live.
        param_groups: torch-style groups whose ``params`` hold tensors from ``params``.
            The group dicts are kept by reference (LR changes reach their owner).

    Raises:
        ValueError: a state key or group parameter that is not in ``params``, a group
            without ``params``, or one tensor under two names.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor | ShardedTensor],
        state: Mapping[Any, Any],
        param_groups: Sequence[Mapping[str, Any]],
    ) -> None:
        torch._C._log_api_usage_once("recopt.optim.KeyedOptimizer")
        init_optimizer_hooks(self)
        self.params = dict(params)
        self.state = state if isinstance(state, dict) else dict(state)  # type: ignore[assignment]
        if isinstance(param_groups, list) and all(isinstance(g, dict) for g in param_groups):
            # The caller's own list and dicts: groups it adds and LR changes stay shared.
            self.param_groups = param_groups
        else:
            self.param_groups = [dict(g) for g in param_groups]
        self.defaults: dict[str, Any] = {}
        self._save_param_groups = False
        validate_structure(self.params, self.state, self.param_groups)

    # ----------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        # Hooks may be lambdas and an LR scheduler patches ``step`` on the instance; neither
        # survives pickling (torch.optim drops them too).
        return {
            k: v
            for k, v in self.__dict__.items()
            if not k.startswith("_optimizer_") and k not in ("step", "_zero_grad_profile_name")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        init_optimizer_hooks(self)

    # ----------------------------------------------------------------- state_dict
    def save_param_groups(self, save: bool) -> None:
        """Whether ``state_dict()`` includes (and ``load_state_dict`` loads) param groups."""
        self._save_param_groups = save

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"state": {name: state}}`` (+ ``"param_groups"`` if saved).

        State tensors are returned by reference so a checkpoint loader can fill them in
        place; clone the result (e.g. ``copy.deepcopy``) to keep a snapshot. State and
        load_state_dict pre/post hooks run as in ``torch.optim.Optimizer``.

        Returns:
            The state dict; a group's ``params`` lists parameter names.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._build_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _build_state_dict(self) -> dict[str, Any]:
        state = {
            name: export_value(self.state[p]) for name, p in self.params.items() if p in self.state
        }
        result: dict[str, Any] = {"state": state}
        if self._save_param_groups:
            name_of = {id(p): name for name, p in self.params.items()}
            result["param_groups"] = [
                {
                    **{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
                    "params": [name_of[id(p)] for p in g["params"]],
                }
                for g in self.param_groups
            ]
        return result

    def _state_keys(self) -> list[str]:
        """Every key this optimizer's ``state_dict()["state"]`` may hold."""
        return list(self.params)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from ``state_dict()`` strictly, copying tensors in place.

        Args:
            state_dict: ``{"state": {name: state}}`` and, when ``save_param_groups(True)``,
                ``"param_groups"`` (matched by their set of parameter names).

        Raises:
            ValueError: this optimizer has no state yet and the state dict has some (call
                ``init_state()`` first), or the reverse; an unknown or missing parameter;
                a state key, shape, dtype or sharding that differs (naming the parameter and
                the key). Nothing is modified when it raises.
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                f"state_dict must be a mapping with a 'state' entry (from state_dict()), got "
                f"{type(state_dict).__name__}"
            )
        loaded: dict[str, Any] = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, loaded)
            if result is not None:
                loaded = result
        self._load(loaded)
        self.post_load_state_dict()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def post_load_state_dict(self) -> None:
        """Called after a successful load, before the load post-hooks; override to react."""

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        self._check_state_dict(state_dict)
        self._apply_state_dict(state_dict)

    def _check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        new_state = top_level_state(state_dict)
        own = {name for name, p in self.params.items() if p in self.state}
        if not own and new_state:
            raise ValueError(
                f"optimizer state is empty (not initialised) but the state_dict has state for "
                f"{describe(new_state)}; call init_state() before load_state_dict()"
            )
        if own and not new_state:
            raise ValueError(
                f"state_dict['state'] is empty but this optimizer is initialised (state for "
                f"{describe(own)}); load a state_dict saved after the first step"
            )
        unknown = set(new_state) - set(self.params)
        if unknown:
            raise ValueError(
                f"state_dict has state for unknown parameters {describe(unknown)}; this "
                f"optimizer has {describe(self.params)}"
            )
        missing = own - set(new_state)
        if missing:
            raise ValueError(f"state_dict has no state for parameters {describe(missing)}")
        uninitialised = set(new_state) - own
        if uninitialised:
            raise ValueError(
                f"parameters {describe(uninitialised)} have no state in this optimizer but do "
                "in the state_dict; call init_state() before load_state_dict()"
            )
        for name in own:
            check_value(f"parameter '{name}'", self.state[self.params[name]], new_state[name])
        if self._save_param_groups:
            self._match_groups(state_dict)

    def _apply_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        new_state = state_dict["state"]
        for name, value in new_state.items():
            param = self.params[name]
            self.state[param] = copy_value(self.state[param], value)
        if self._save_param_groups:
            for group, new_group in self._match_groups(state_dict):
                for key, value in new_group.items():
                    if key != "params":
                        group[key] = copy.deepcopy(value)

    def _match_groups(self, state_dict: Mapping[str, Any]) -> list[tuple[dict[str, Any], Any]]:
        if "param_groups" not in state_dict:
            raise ValueError(
                "state_dict has no 'param_groups' but save_param_groups(True) is set; save "
                "with save_param_groups(True), or call save_param_groups(False) before loading"
            )
        new_groups = saved_param_groups(state_dict)
        if len(new_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(new_groups)} param groups, this optimizer "
                f"{len(self.param_groups)}; save and load with the same groups"
            )
        name_of = {id(p): name for name, p in self.params.items()}
        by_names = {frozenset(str(n) for n in g["params"]): g for g in new_groups}
        pairs = []
        for group in self.param_groups:
            names = frozenset(name_of[id(p)] for p in group["params"])
            new_group = by_names.get(names)
            if new_group is None:
                raise ValueError(f"state_dict has no param group with params {describe(names)}")
            missing = set(group) - set(new_group) - _OPTIONAL_GROUP_KEYS
            if missing:
                raise ValueError(
                    f"param group with params {describe(names)}: state_dict lacks "
                    f"{describe(missing)}; load param groups saved by the same optimizer type"
                )
            pairs.append((group, new_group))
        return pairs

    # ----------------------------------------------------------------- init_state
    def init_state(self, sparse_grad_parameter_names: Iterable[str] | None = None) -> None:
        """Create the lazily initialised state of every trainable parameter that has none.

        Runs one step on zero gradients with weight decay switched off, then restores the
        weights and resets ``step`` counters to 0, so weights and step counts are exactly
        as before (the reference's dummy step moves weights under weight decay and counts a
        step). Other step-derived state (e.g. NAdam's ``mu_product``) reflects one
        zero-gradient step; loading a checkpoint overwrites it. Parameters that already
        have state, ShardedTensor parameters and frozen parameters are left alone. Step
        hooks and LR schedulers do not see this step. Costs one copy of the weights.
        A pending gradient is restored; a parameter that had none keeps the zero gradient
        of the step (sparse where asked), as TorchRec's ``init_state`` leaves it.

        Args:
            sparse_grad_parameter_names: parameters whose zero gradient must be sparse
                (for optimizers like ``SparseAdam`` that reject dense gradients).

        Raises:
            ValueError: a name in ``sparse_grad_parameter_names`` is not a parameter.
        """
        sparse = set(sparse_grad_parameter_names or ())
        unknown = sparse - set(self.params)
        if unknown:
            raise ValueError(
                f"sparse_grad_parameter_names has unknown parameters {describe(unknown)}; "
                f"known: {describe(self.params)}"
            )
        grouped = {id(p): p for g in self.param_groups for p in g["params"]}
        targets = {
            name: p
            for name, p in self.params.items()
            if id(p) in grouped
            and not isinstance(p, ShardedTensor)
            and p.requires_grad
            and p not in self.state
        }
        if targets:
            zero_grad_step(self, list(grouped.values()), targets, sparse)

    def _raw_step(self) -> None:
        """This optimizer's own update, without hooks (used by ``init_state``)."""
        unhooked_step(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported by a bare KeyedOptimizer, whose parameters come from its owner.

        Raises:
            NotImplementedError: always; use ``KeyedOptimizerWrapper.add_param_group``.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot add param groups; its parameters and state belong "
            "to its owner (use KeyedOptimizerWrapper.add_param_group with named params)"
        )


class KeyedOptimizerWrapper(KeyedOptimizer):
    """Any ``torch.optim`` optimizer (Adam, Adafactor, SparseAdam, ...) as a KeyedOptimizer.

    Args:
        params: parameter name -> tensor.
        optim_factory: builds the optimizer from the list of tensors, e.g.
            ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``.

    Raises:
        ValueError: the factory's optimizer holds a tensor that is not in ``params``.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        optim_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    ) -> None:
        self._optimizer = optim_factory(list(params.values()))
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)
        self.defaults = self._optimizer.defaults

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Run the wrapped optimizer's step; returns the closure's loss if one is given."""
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (``None`` by default, as in torch.optim)."""
        self._optimizer.zero_grad(set_to_none)

    def _raw_step(self) -> None:
        unhooked_step(self._optimizer)

    def init_state(self, sparse_grad_parameter_names: Iterable[str] | None = None) -> None:
        """As ``KeyedOptimizer.init_state``; with ``SparseAdam`` every zero gradient is sparse."""
        if sparse_grad_parameter_names is None and isinstance(
            self._optimizer, torch.optim.SparseAdam
        ):
            sparse_grad_parameter_names = list(self.params)
        super().init_state(sparse_grad_parameter_names)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group whose ``params`` are ``(name, tensor)`` pairs (or known tensors).

        Args:
            param_group: torch-style group; hyperparameters default to the optimizer's.

        Raises:
            ValueError: an unnamed new tensor, or a name already bound to another tensor.
        """
        group = dict(param_group)
        items = group.get("params")
        if items is None:
            raise ValueError("param_group has no 'params' entry")
        known = {id(p) for p in self.params.values()}
        new_names: dict[str, torch.Tensor] = {}
        tensors = []
        for item in [items] if isinstance(items, (torch.Tensor, tuple)) else list(items):
            if isinstance(item, tuple):
                name, tensor = item
                bound = new_names.get(name, self.params.get(name))
                if bound is not None and bound is not tensor:
                    raise ValueError(
                        f"param name '{name}' is already bound to another tensor; "
                        "choose another name"
                    )
                new_names[name] = tensor
            elif id(item) not in known:
                raise ValueError(
                    "add_param_group needs a name for every new tensor: "
                    "pass params as (name, tensor) pairs"
                )
            else:
                tensor = item
            tensors.append(tensor)
        group["params"] = tensors
        self._optimizer.add_param_group(group)
        self.params.update(new_names)


class OptimizerWrapper(KeyedOptimizer):
    """Base of wrappers: a KeyedOptimizer that delegates everything to a wrapped one.

    ``params``, ``state``, ``param_groups`` and ``defaults`` are the wrapped optimizer's own
    objects (live), so LR schedulers and loads reach it. Subclasses override ``step`` etc.;
    they call ``self._optimizer.step`` (never ``super().step``, whose hooks would fire twice).

    Args:
        optimizer: the KeyedOptimizer to wrap.
    """

    def __init__(self, optimizer: KeyedOptimizer) -> None:
        if not isinstance(optimizer, KeyedOptimizer):
            raise ValueError(
                f"optimizer must be a KeyedOptimizer, got {type(optimizer).__name__}; "
                "wrap torch optimizers in KeyedOptimizerWrapper"
            )
        torch._C._log_api_usage_once("recopt.optim.OptimizerWrapper")
        self._optimizer = optimizer
        init_optimizer_hooks(self)

    @property
    def params(self) -> dict[str, Any]:
        return self._optimizer.params

    @params.setter
    def params(self, value: dict[str, Any]) -> None:
        raise AttributeError(
            f"set params on the wrapped optimizer ({type(self._optimizer).__name__})"
        )

    @property
    def state(self) -> Any:
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError(
            f"set state on the wrapped optimizer ({type(self._optimizer).__name__})"
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        raise AttributeError(
            f"set param_groups on the wrapped optimizer ({type(self._optimizer).__name__})"
        )

    @property
    def defaults(self) -> dict[str, Any]:
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        raise AttributeError(
            f"set defaults on the wrapped optimizer ({type(self._optimizer).__name__})"
        )

    @property
    def wrapped(self) -> KeyedOptimizer:
        """The wrapped optimizer."""
        return self._optimizer

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the wrapped optimizer."""
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients through the wrapped optimizer."""
        self._optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer."""
        self._optimizer.add_param_group(param_group)

    def init_state(self, sparse_grad_parameter_names: Iterable[str] | None = None) -> None:
        """Initialise the wrapped optimizer's state (see ``KeyedOptimizer.init_state``)."""
        self._optimizer.init_state(sparse_grad_parameter_names)

    def save_param_groups(self, save: bool) -> None:
        """Whether the wrapped optimizer saves and loads param groups."""
        self._optimizer.save_param_groups(save)

    def _build_state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def _state_keys(self) -> list[str]:
        return self._optimizer._state_keys()

    def _check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._optimizer._check_state_dict(state_dict)

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)
        self._wrapped_post_loaded = True  # (its load ran its post_load_state_dict)

    def post_load_state_dict(self) -> None:
        """The wrapped optimizer's ``post_load_state_dict`` (after its state tensors were
        filled in place, as a DCP load does); after `load_state_dict`, which ran it, nothing."""
        if self.__dict__.pop("_wrapped_post_loaded", False):
            return
        self._optimizer.post_load_state_dict()
