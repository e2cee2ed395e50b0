"""KeyedOptimizer: an optimizer whose state_dict is keyed by parameter name, not by index.

Minimal first version (the optimizer issue completes it: strict loading, init_state, wrappers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class KeyedOptimizer(torch.optim.Optimizer):
    """Exposes ``state_dict()`` keyed by parameter name.

    Args:
        params: parameter name -> tensor (or ShardedTensor).
        state: parameter tensor -> its state dict (tensors or Python scalars).
        param_groups: torch-style groups whose ``params`` hold tensors from ``params``.
    """

    def __init__(
        self,
        params: Mapping[str, Any],
        state: Mapping[Any, Any],
        param_groups: Sequence[Mapping[str, Any]],
    ) -> None:
        torch._C._log_api_usage_once("recopt.optim.KeyedOptimizer")
        self.params = dict(params)
        self.state = dict(state)  # type: ignore[assignment]
        self.param_groups = [dict(g) for g in param_groups]
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._save_param_groups = False

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        name_of = {id(p): n for n, p in self.params.items()}
        state = {name_of[id(p)]: dict(s) for p, s in self.state.items()}
        result: dict[str, Any] = {"state": state}
        if self._save_param_groups:
            result["param_groups"] = [
                {**{k: v for k, v in g.items() if k != "params"},
                 "params": [name_of[id(p)] for p in g["params"]]}
                for g in self.param_groups
            ]
        return result

    def save_param_groups(self, save: bool) -> None:
        self._save_param_groups = save
