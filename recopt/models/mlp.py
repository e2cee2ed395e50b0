"""MLP layers that run their fp32 matmuls in oneDNN on CPU, with ReLU fused into the matmul.

On CPU, ``nn.Linear`` calls MKL's sgemm. On the AMD EPYC machines we benchmark on, oneDNN's
fp32 kernels (``torch.ops.mkldnn._linear_pointwise``, the op torch's compiler emits for CPU
linear layers) run the same products in about half the CPU time, exact fp32 both ways.
`FusedLinear` uses that op for forward and for both backward products, and falls back to
``nn.functional.linear`` anywhere else (GPU, other dtypes, a torch without oneDNN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("none", "relu")


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_linear_available()


def _onednn_linear(
    x_B_I: torch.Tensor, weight_O_I: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    result: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x_B_I, weight_O_I, bias, activation, [], ""
    )
    return result


class _OneDnnLinear(torch.autograd.Function):
    """``act(x @ W.T + b)`` with every product in oneDNN; ReLU's mask comes from the output."""

    @staticmethod
    def forward(
        ctx: Any,
        x_B_I: torch.Tensor,
        weight_O_I: torch.Tensor,
        bias_O: torch.Tensor | None,
        activation: str,
    ) -> torch.Tensor:
        out_B_O = _onednn_linear(x_B_I, weight_O_I, bias_O, activation)
        ctx.activation = activation
        ctx.has_bias = bias_O is not None
        ctx.save_for_backward(x_B_I, weight_O_I, out_B_O)
        return out_B_O

    @staticmethod
    def backward(ctx: Any, grad_B_O: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_B_I, weight_O_I, out_B_O = ctx.saved_tensors
        if ctx.activation == "relu":
            # One pass (what autograd runs for relu), not a compare and a multiply.
            grad_B_O = torch.ops.aten.threshold_backward(grad_B_O, out_B_O, 0)
        grad_B_O = grad_B_O.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # x' = g @ W: a "linear" with weight W.T ([I, O]).
            grad_x = _onednn_linear(grad_B_O, weight_O_I.t().contiguous(), None, "none")
        if ctx.needs_input_grad[1]:
            # W' = g.T @ x: a "linear" of g.T ([O, B]) with weight x.T ([I, B]).
            grad_w = _onednn_linear(grad_B_O.t().contiguous(), x_B_I.t().contiguous(), None, "none")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_B_O.sum(0)
        return grad_x, grad_w, grad_b, None


class FusedLinear(nn.Linear):
    """``nn.Linear`` followed by an optional ReLU, computed as one oneDNN op on CPU.

    Same parameters (``weight`` [out, in], ``bias`` [out]) and initialisation as
    ``nn.Linear``; results equal ``relu(linear(x))`` up to fp32 rounding.

    Args:
        in_features: input width.
        out_features: output width.
        activation: ``none`` or ``relu``.
        bias: whether the layer has a bias.
        use_onednn: route fp32 CPU inputs through oneDNN (False: always ``F.linear``).

    Raises:
        ValueError: on an unknown activation.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        activation: str = "none",
        bias: bool = True,
        use_onednn: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is unknown; use one of {ACTIVATIONS}")
        self.activation = activation
        self.use_onednn = use_onednn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.use_onednn
            and _ONEDNN
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and x.dim() == 2
            and x.shape[0] > 0  # oneDNN's backward product has no descriptor for B = 0
        ):
            result: torch.Tensor = _OneDnnLinear.apply(
                x.contiguous(), self.weight, self.bias, self.activation
            )
            return result
        out = F.linear(x, self.weight, self.bias)
        return F.relu(out) if self.activation == "relu" else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"


def mlp(
    in_features: int,
    widths: Sequence[int],
    final_relu: bool = True,
    use_onednn: bool = True,
) -> nn.Sequential:
    """Linear layers of the given widths with ReLU after each (after the last if asked).

    Args:
        in_features: input width.
        widths: output width of each layer.
        final_relu: whether the last layer is followed by a ReLU too.
        use_onednn: see `FusedLinear`.

    Returns:
        An ``nn.Sequential`` of `FusedLinear` layers (parameters ``<i>.weight``, ``<i>.bias``).
    """
    layers: list[nn.Module] = []
    for i, width in enumerate(widths):
        relu = final_relu or i < len(widths) - 1
        layers.append(
            FusedLinear(in_features, width, "relu" if relu else "none", use_onednn=use_onednn)
        )
        in_features = width
    return nn.Sequential(*layers)
