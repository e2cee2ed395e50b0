"""FaultTolerantOptimizer: a torch optimizer whose steps commit only when the whole quorum agrees.

``zero_grad()`` opens the step (quorum, healing) and ``step()`` averages the gradients over
the replicas, votes, and runs the wrapped optimizer only on a yes; on a no the parameters
and the optimizer state are left exactly as they were. Each ``step()`` must follow its own
``zero_grad()``, and closures are refused: a closure's gradients would be computed after the
all-reduce and never averaged across replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from recopt.ft.steps import StepTransaction


class FaultTolerantOptimizer(torch.optim.Optimizer):
    """Wrap ``optim`` so that each step is a fault-tolerant transaction run by ``manager``.

    Call ``zero_grad()`` before the forward pass and ``step()`` after backward. Everything
    else (``param_groups``, ``state``, ``state_dict``, ``load_state_dict``,
    ``add_param_group``) is the wrapped optimizer's, so LR schedulers and checkpoints work on
    the wrapper as on ``optim``. torch's hook API (``register_step_pre_hook`` and the others)
    registers on the wrapped optimizer: step hooks run only when a step commits, and receive
    the wrapped optimizer.

    ``step(closure)`` is refused: a closure recomputes the loss and gradients inside the
    step, after the gradients were averaged, so replicas would apply different gradients.
    Run the forward and backward passes before ``step()`` instead.

    Args:
        manager: the replica group's manager.
        optim: the optimizer of the dense parameters.
        allreduce_gradients: average the gradients of ``optim``'s parameters over the
            replicas in ``step()``; turn off when something else (a DDP-like wrapper) does.
    """

    def __init__(
        self,
        manager: StepTransaction,
        optim: torch.optim.Optimizer,
        *,
        allreduce_gradients: bool = True,
    ) -> None:
        # The base initialiser is not called: all state lives in the wrapped optimizer.
        self.manager = manager
        self.optim = optim
        self.allreduce_gradients = allreduce_gradients
        # True between zero_grad() (which joins the step's quorum) and the step() it opens.
        self._step_open = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optim.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start the step's quorum (healing this replica if it is behind), then zero grads."""
        self.manager.start_quorum()
        self._step_open = True
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Average gradients, vote, and apply the wrapped optimizer only if the step commits.

        Args:
            closure: must be None (see the class docstring).

        Returns:
            The wrapped optimizer's return value on a commit, None on a dropped step.

        Raises:
            ValueError: a closure was given.
            RuntimeError: no ``zero_grad()`` since the last ``step()``: the step would be
                committed again on the previous quorum round.
        """
        if closure is not None:
            raise ValueError(
                "OptimizerWrapper.step(closure) is not supported: the closure's gradients "
                "would be computed after the all-reduce and never averaged across replicas; "
                "run forward and backward before calling step() without a closure"
            )
        if not self._step_open:
            raise RuntimeError(
                "OptimizerWrapper.step() called without zero_grad() since the last step: it "
                "would commit again on the previous quorum round; call optimizer.zero_grad() "
                "before the forward pass of every step (it joins the step's quorum)"
            )
        self._step_open = False
        if self.allreduce_gradients:
            params = [p for group in self.optim.param_groups for p in group["params"]]
            self.manager.allreduce_gradients(params)
        if self.manager.should_commit():
            loss: float | None = self.optim.step()
            return loss
        return None

    # torch's hook API, on the wrapped optimizer (this wrapper holds no hook tables itself).
    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Register ``hook`` to run before each committed step of the wrapped optimizer."""
        return self.optim.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Register ``hook`` to run after each committed step of the wrapped optimizer."""
        return self.optim.register_step_post_hook(hook)

    def register_state_dict_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """Register a hook run before the wrapped optimizer's ``state_dict()``."""
        return self.optim.register_state_dict_pre_hook(hook, prepend=prepend)

    def register_state_dict_post_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """Register a hook run after the wrapped optimizer's ``state_dict()``."""
        return self.optim.register_state_dict_post_hook(hook, prepend=prepend)

    def register_load_state_dict_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """Register a hook run before the wrapped optimizer's ``load_state_dict()``."""
        return self.optim.register_load_state_dict_pre_hook(hook, prepend=prepend)

    def register_load_state_dict_post_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """Register a hook run after the wrapped optimizer's ``load_state_dict()``."""
        return self.optim.register_load_state_dict_post_hook(hook, prepend=prepend)

    def __repr__(self) -> str:
        return f"FaultTolerantOptimizer({self.optim!r})"
