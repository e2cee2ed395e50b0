"""Storage precision of embedding weights and optimizer state, and stochastic rounding.

Tables and optimizer state can be stored in fp32 (default), fp16 or bf16. Updates are always
computed in fp32 and written back with unbiased stochastic rounding (`stochastic_round`), drawn
from a seeded generator per kernel, so a run is reproducible and rounding errors average out.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Sequence

import torch

Tensor = torch.Tensor


class Precision(enum.StrEnum):
    """How a table's weights or its optimizer state are stored."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of this precision."""
        return _DTYPES[self]

    @property
    def bytes(self) -> int:
        """Bytes per stored value."""
        return 4 if self is Precision.FP32 else 2

    @property
    def reduced(self) -> bool:
        """True for fp16 and bf16 (updates are rounded into them)."""
        return self is not Precision.FP32


_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.FP16: torch.float16,
    Precision.BF16: torch.bfloat16,
}
_ALIASES: dict[object, Precision] = {
    "fp32": Precision.FP32,
    "float32": Precision.FP32,
    "float": Precision.FP32,
    "fp16": Precision.FP16,
    "float16": Precision.FP16,
    "half": Precision.FP16,
    "bf16": Precision.BF16,
    "bfloat16": Precision.BF16,
    torch.float32: Precision.FP32,
    torch.float16: Precision.FP16,
    torch.bfloat16: Precision.BF16,
}


def parse_precision(value: object, field: str) -> Precision:
    """A `Precision` from what a user would write: ``"fp16"``, ``"bfloat16"``, ``torch.float16``.

    Args:
        value: a `Precision`, a name (case-insensitive, ``torch.`` prefix allowed) or a dtype.
        field: what is being set, for the error message (e.g. ``table 'user': weight_dtype``).

    Raises:
        ValueError: naming the field, the value and the valid values.
    """
    if isinstance(value, Precision):
        return value
    key: object = value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
    found = _ALIASES.get(key) if isinstance(key, str | torch.dtype) else None
    if found is None:
        raise ValueError(
            f"{field}: {value!r} is not a supported precision; use one of 'fp32', 'fp16', "
            "'bf16' (or torch.float32, torch.float16, torch.bfloat16)"
        )
    return found


def precision_of(dtype: torch.dtype) -> Precision:
    """The `Precision` of a tensor dtype.

    Raises:
        ValueError: the dtype is not fp32, fp16 or bf16.
    """
    return parse_precision(dtype, "tensor dtype")


def rounding_seed(seed: int, names: Sequence[str]) -> int:
    """A stable 63-bit seed for one kernel: the config's seed mixed with its tables' names.

    Stable across processes (unlike ``hash``), so runs repeat; different per kernel and shard.
    """
    digest = zlib.crc32("\0".join(names).encode())
    return (int(seed) * 0x9E3779B1 + digest) % (2**63)


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """Round float32 ``x`` to ``dtype`` up or down at random, with expectation exactly ``x``.

    ``x`` lies between two neighbours ``lo <= x <= hi`` of ``dtype``; it becomes ``hi`` with
    probability ``(x - lo) / (hi - lo)`` and ``lo`` otherwise, so ``E[result] = x`` (unbiased),
    unlike round-to-nearest, which loses every update smaller than half a unit in the last
    place. Values already representable are unchanged; values beyond the dtype's largest
    finite value, inf and NaN become what a plain cast gives.

    Args:
        x: float32 values.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (``torch.float32``: returned as is).
        generator: the random stream (on ``x``'s device); one uniform draw per element.

    Returns:
        ``x`` rounded to ``dtype``.
    """
    if dtype == torch.float32:
        return x
    nearest = x.to(dtype)
    back = nearest.float()
    # The other neighbour of x: one step from the nearest value towards x.
    toward = torch.where(back < x, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(nearest, toward)
    other_f = other.float()
    gap = (other_f - back).abs()
    # Probability of taking the other neighbour: x's distance from the nearest, over the gap.
    p_other = torch.where(gap > 0, (x - back).abs() / gap, torch.zeros_like(x))
    u = torch.rand(x.shape, generator=generator, device=x.device)
    take_other = (u < p_other) & torch.isfinite(other_f) & torch.isfinite(back)
    return torch.where(take_other, other, nearest)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` (CPU or an accelerator) seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
