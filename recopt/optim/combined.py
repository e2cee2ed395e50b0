"""CombinedOptimizer: several KeyedOptimizers (e.g. fused embeddings + dense AdamW) as one.

Keys are prefixed with the child's name (``child.param``); ``state`` and ``param_groups``
are live views of the children's, so LR schedulers and loads reach them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from recopt.optim._state import (
    describe,
    init_optimizer_hooks,
    saved_param_groups,
    top_level_state,
)
from recopt.optim.keyed import KeyedOptimizer, evaluated


def _prefixed(child: str, key: str) -> str:
    return f"{child}.{key}" if child else key


class _CombinedState(MutableMapping[Any, Any]):
    """param tensor -> state, read from and written to the child that owns the param."""

    def __init__(self, owner: CombinedOptimizer) -> None:
        self._owner = owner

    def _child_of(self, param: Any) -> KeyedOptimizer:
        for _, opt in self._owner.optimizers:
            if any(p is param for p in opt.params.values()):
                return opt
        raise KeyError(param)

    def __getitem__(self, param: Any) -> Any:
        for _, opt in self._owner.optimizers:
            if param in opt.state:
                return opt.state[param]
        raise KeyError(param)

    def __setitem__(self, param: Any, value: Any) -> None:
        self._child_of(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._child_of(param).state[param]

    def __iter__(self) -> Iterator[Any]:
        for _, opt in self._owner.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for _, opt in self._owner.optimizers)


class CombinedOptimizer(KeyedOptimizer):
    """Steps, saves and loads several KeyedOptimizers as one.

    Args:
        optims: KeyedOptimizers, each optionally as ``(name, optimizer)``. A named child's
            keys become ``name.key``; an unnamed child's keys are kept as they are.

    Raises:
        ValueError: a child that is not a KeyedOptimizer, two children with one name, or
            two children producing the same key.
    """

    def __init__(self, optims: Sequence[KeyedOptimizer | tuple[str, KeyedOptimizer]]) -> None:
        torch._C._log_api_usage_once("recopt.optim.CombinedOptimizer")
        children: list[tuple[str, KeyedOptimizer]] = []
        for i, item in enumerate(optims):
            name, opt = item if isinstance(item, tuple) else ("", item)
            if not isinstance(opt, KeyedOptimizer):
                raise ValueError(
                    f"optims[{i}] is a {type(opt).__name__}, not a KeyedOptimizer; wrap torch "
                    "optimizers in KeyedOptimizerWrapper"
                )
            if name and name in (n for n, _ in children):
                raise ValueError(
                    f"optims[{i}]: child name '{name}' is used twice; names must be unique"
                )
            children.append((name, opt))
        self._optims = children
        self._save_param_groups = False
        init_optimizer_hooks(self)
        self._routes()  # raises on duplicate keys

    @property
    def optimizers(self) -> list[tuple[str, KeyedOptimizer]]:
        """The ``(name, optimizer)`` children, in order."""
        return list(self._optims)

    @property
    def params(self) -> dict[str, Any]:
        return {
            _prefixed(name, key): p for name, opt in self._optims for key, p in opt.params.items()
        }

    @params.setter
    def params(self, value: dict[str, Any]) -> None:
        raise AttributeError("CombinedOptimizer.params is a view; change the children instead")

    @property  # type: ignore[override]
    def state(self) -> MutableMapping[Any, Any]:
        return _CombinedState(self)

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError("CombinedOptimizer.state is a view; change the children instead")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        # The children's own dicts, so a scheduler writing group["lr"] reaches them.
        return [g for _, opt in self._optims for g in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        raise AttributeError(
            "CombinedOptimizer.param_groups is a view; change the children instead"
        )

    @property
    def defaults(self) -> dict[str, Any]:
        """The children's defaults merged, the first child's value where several have a key
        (schedulers read them: OneCycleLR's momentum cycling needs ``momentum`` or ``betas``
        there). A copy: setting it is refused, change a child's."""
        merged: dict[str, Any] = {}
        for _, opt in reversed(self._optims):
            merged.update(opt.defaults)
        return merged

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        raise AttributeError("CombinedOptimizer has no defaults of its own")

    def _routes(self) -> dict[str, tuple[int, str]]:
        routes: dict[str, tuple[int, str]] = {}
        for i, (name, opt) in enumerate(self._optims):
            for key in opt._state_keys():
                full = _prefixed(name, key)
                if full in routes:
                    other = self._optims[routes[full][0]][0] or f"#{routes[full][0]}"
                    raise ValueError(
                        f"key '{full}' comes from two children ('{other}' and "
                        f"'{name or f'#{i}'}'); name the children to tell them apart"
                    )
                routes[full] = (i, key)
        return routes

    def _state_keys(self) -> list[str]:
        return list(self._routes())

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Evaluate ``closure`` once (if given), then step every child; returns its loss.

        Each child's ``step`` gets a closure returning that loss (``None`` without one), so
        the model is evaluated once however many children there are.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, opt in self._optims:
            opt.step(None if closure is None else evaluated(loss))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every child."""
        for _, opt in self._optims:
            opt.zero_grad(set_to_none)

    def save_param_groups(self, save: bool) -> None:
        """Whether param groups are saved and loaded, here and in every child."""
        self._save_param_groups = save
        for _, opt in self._optims:
            opt.save_param_groups(save)

    def init_state(self, sparse_grad_parameter_names: Iterable[str] | None = None) -> None:
        """Initialise every child's state (names are the prefixed ones).

        Raises:
            ValueError: a name in ``sparse_grad_parameter_names`` is not a parameter.
        """
        per_child: list[list[str]] = [[] for _ in self._optims]
        routes = self._routes()
        for full in sparse_grad_parameter_names or ():
            if full not in routes or full not in self.params:
                raise ValueError(
                    f"sparse_grad_parameter_names: '{full}' is not a parameter; known: "
                    f"{describe(self.params)}"
                )
            per_child[routes[full][0]].append(routes[full][1])
        for (_, opt), names in zip(self._optims, per_child, strict=True):
            # no names given: each child works out its own (SparseAdam's are all sparse)
            opt.init_state(None if sparse_grad_parameter_names is None else names)

    def _build_state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        for name, opt in self._optims:
            child = opt.state_dict()
            state.update({_prefixed(name, k): v for k, v in child["state"].items()})
            for g in child.get("param_groups", []):
                groups.append({**g, "params": [_prefixed(name, k) for k in g["params"]]})
        result: dict[str, Any] = {"state": state}
        if self._save_param_groups:
            result["param_groups"] = groups
        return result

    def _split(self, state_dict: Mapping[str, Any]) -> list[dict[str, Any]]:
        new_state = top_level_state(state_dict)
        routes = self._routes()
        parts: list[dict[str, Any]] = [{"state": {}} for _ in self._optims]
        for full, value in new_state.items():
            if full not in routes:
                raise ValueError(
                    f"state_dict has state for unknown key '{full}'; this optimizer has "
                    f"{describe(routes)}"
                )
            i, key = routes[full]
            parts[i]["state"][key] = value
        if "param_groups" in state_dict:
            for part in parts:
                part["param_groups"] = []
            for g in saved_param_groups(state_dict):
                owners = {routes[k] if k in routes else None for k in g["params"]}
                children = {owner[0] for owner in owners if owner is not None}
                if None in owners or len(children) != 1:
                    raise ValueError(
                        f"param group with params {describe(map(str, g['params']))} does not "
                        "belong to exactly one child optimizer"
                    )
                i = children.pop()
                local = [routes[k][1] for k in g["params"]]
                parts[i]["param_groups"].append({**g, "params": local})
        return parts

    def _check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for (_, opt), part in zip(self._optims, self._split(state_dict), strict=True):
            opt._check_state_dict(part)

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        # Check every child before loading any, so a bad state_dict changes nothing.
        parts = self._split(state_dict)
        for (_, opt), part in zip(self._optims, parts, strict=True):
            opt._check_state_dict(part)
        for (_, opt), part in zip(self._optims, parts, strict=True):
            opt.load_state_dict(part)
        self._children_post_loaded = True  # (each child's load ran its post_load_state_dict)

    def post_load_state_dict(self) -> None:
        """Every child's ``post_load_state_dict`` (after their state tensors were filled in
        place, as a DCP load does); after `load_state_dict`, which ran them, nothing."""
        if self.__dict__.pop("_children_post_loaded", False):
            return
        for _, opt in self._optims:
            opt.post_load_state_dict()
