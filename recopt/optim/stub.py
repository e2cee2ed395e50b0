"""OptimizerStub: a torch.optim.Optimizer that never updates anything.

For trainers whose weights change without gradients (evolution strategies, fused-in-backward
modules, frozen parts) but whose tooling expects an optimizer: hooks, state_dict round trip,
param groups and LR schedulers all work as in torch.optim.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from recopt.optim._state import init_optimizer_hooks, saved_param_groups


class OptimizerStub(torch.optim.Optimizer):
    """An optimizer whose ``step`` runs the closure (if any) and touches no gradient.

    Args:
        params: tensors or param groups, as for any torch optimizer; may be empty.
        **defaults: group hyperparameters; ``lr`` defaults to 0.0 so LR schedulers work.
    """

    def __init__(self, params: Iterable[Any] = (), **defaults: Any) -> None:
        torch._C._log_api_usage_once("recopt.optim.OptimizerStub")
        # torch.optim.Optimizer.__init__ rejects an empty parameter list; a stub may have none.
        self.defaults = {"lr": 0.0, **defaults}
        init_optimizer_hooks(self)
        self.state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Run ``closure`` (with gradients enabled) if given and return its value.

        Args:
            closure: re-evaluates the model; its gradients are neither read nor changed.

        Returns:
            The closure's return value, or None.
        """
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from ``state_dict()``, as ``torch.optim.Optimizer`` does.

        Args:
            state_dict: ``{"state": ..., "param_groups": [...]}``.

        Raises:
            ValueError: the state dict is not a mapping, lacks ``state`` or
                ``param_groups``, or a group lacks ``params`` (torch would raise a bare
                KeyError), or its groups do not match this optimizer's.
        """
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
            raise ValueError(
                "state_dict must be a dict with a 'state' dict and a 'param_groups' list "
                f"(from OptimizerStub.state_dict()); got {state_dict!r:.80}"
            )
        saved_param_groups(state_dict)
        super().load_state_dict(state_dict)
