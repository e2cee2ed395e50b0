"""``torchrec.modules.mlp.MLP``: TorchRec's signature over recopt's `FusedLinear` layers.

With ReLU (TorchRec's default) each layer is one `FusedLinear` (matmul and ReLU fused in
oneDNN on CPU); another activation callable or module runs after a plain linear layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from recopt.models.mlp import FusedLinear

Activation = str | nn.Module | Callable[[torch.Tensor], torch.Tensor]


def _is_relu(activation: Activation) -> bool:
    return (
        activation in ("relu", torch.relu, nn.functional.relu)
        or isinstance(activation, nn.ReLU)
        or activation is nn.ReLU
    )


class _Activated(nn.Module):
    """A linear layer followed by an activation callable that is not ReLU."""

    def __init__(self, linear: nn.Linear, activation: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.linear = linear
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))


class MLP(nn.Module):
    """Linear layers of ``layer_sizes`` widths, each followed by ``activation``.

    Args:
        in_size: input width.
        layer_sizes: output width of each layer.
        bias: whether the layers have biases.
        activation: ``torch.relu`` (default), ``"relu"``, ``nn.ReLU()``, or any callable or
            module taking and returning a tensor (a module class is instantiated).
        device: where the parameters live.
        dtype: their dtype.
        activation_on_last: whether the last layer is followed by the activation too.

    Raises:
        ValueError: an activation given by a name other than ``"relu"`` (TorchRec's
            ``"swish_layernorm"`` is not offered), or an empty ``layer_sizes``.
    """

    def __init__(
        self,
        in_size: int,
        layer_sizes: Sequence[int],
        bias: bool = True,
        activation: Activation = torch.relu,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        activation_on_last: bool = True,
    ) -> None:
        super().__init__()
        if not layer_sizes:
            raise ValueError("MLP layer_sizes is empty; give at least one output width")
        if isinstance(activation, str) and activation != "relu":
            raise ValueError(
                f"MLP activation {activation!r} is not offered; pass 'relu' or a callable/module"
            )
        if isinstance(activation, type) and issubclass(activation, nn.Module):
            activation = activation()
        assert not isinstance(activation, type)
        layers: list[nn.Module] = []
        for i, width in enumerate(layer_sizes):
            active = activation_on_last or i < len(layer_sizes) - 1
            relu = active and _is_relu(activation)
            linear = FusedLinear(in_size, width, "relu" if relu else "none", bias=bias)
            if active and not relu:
                assert callable(activation) and not isinstance(activation, str)
                layers.append(_Activated(linear, activation))
            else:
                layers.append(linear)
            in_size = width
        self._mlp = nn.Sequential(*layers).to(device=device, dtype=dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``[*, in_size] -> [*, layer_sizes[-1]]``."""
        out: torch.Tensor = self._mlp(input)
        return out
