"""Storage precision of embedding weights and optimizer state, and stochastic rounding.

Tables and optimizer state can be stored in fp32 (default), fp16 or bf16. Updates are always
computed in fp32 and written back with unbiased stochastic rounding (`stochastic_round`), drawn
from a seeded generator per kernel, so a run is reproducible and rounding errors average out.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Sequence

import torch

from recopt.kernels import cpu_fused

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


def rounding_seed(seed: int, names: Sequence[str]) -> int:
    """A stable 63-bit seed for one kernel: the config's seed mixed with its tables' names.

    Stable across processes (unlike ``hash``), so runs repeat; different per kernel and shard.
    """
    digest = zlib.crc32("\0".join(names).encode())
    return (int(seed) * 0x9E3779B1 + digest) % (2**63)


# Mantissa bits fp32 has beyond each reduced dtype, and the smallest normal of each: below
# it fp16's values are evenly spaced by 2^-24 (bf16 shares fp32's exponent range).
_DROPPED_BITS = {torch.float16: 13, torch.bfloat16: 16}
_FP16_MIN_NORMAL = 2.0**-14
_FP16_SUBNORMAL_STEP = 2.0**-24


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """Round float32 ``x`` to ``dtype`` up or down at random, with expectation ``x``.

    ``x`` lies between two neighbours ``lo <= x <= hi`` of ``dtype``; it becomes ``hi`` with
    probability ``(x - lo) / (hi - lo)`` and ``lo`` otherwise, so ``E[result] = x`` (unbiased,
    to the 2^-13 (fp16) or 2^-16 (bf16) resolution of one random integer per element), unlike
    round-to-nearest, which loses every update smaller than half a unit in the last place.

    How: a random integer below 2^k (k: the mantissa bits fp32 has beyond ``dtype``) is added
    to the magnitude's bit pattern and the k low bits are cleared, which truncates
    ``|x| + u * ulp`` (u uniform in [0, 1)) and so rounds the magnitude up with the
    probability above; the sign is kept. fp16's subnormal range (below 2^-14, even steps of
    2^-24) is rounded by adding ``(u - 1/2) * 2^-24`` and rounding to nearest, the same law.
    On CPU a native pass does the same with 32 hashed random bits per element (seeded by one
    draw from ``generator``; subnormals with 24-bit resolution). Values already representable
    are unchanged, inf stays inf, NaN stays NaN; a value past the largest finite one has inf
    as its upper neighbour.

    Args:
        x: float32 values.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (``torch.float32``: returned as is).
        generator: the random stream (on ``x``'s device; advanced by every call).

    Returns:
        ``x`` rounded to ``dtype``.
    """
    if dtype == torch.float32:
        return x
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_fused.available():
        # One draw from the stream seeds the native pass (a hash per element; ~20x faster).
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        return cpu_fused.stochastic_round(x, dtype, seed)
    return stochastic_round_torch(x, dtype, generator)


def stochastic_round_torch(x: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """`stochastic_round` in torch ops (any device); the CPU uses the native pass instead."""
    bits = _DROPPED_BITS[dtype]
    x = x.contiguous()
    noise = _random_bits(x.shape, bits, generator)
    # Adding to the pattern carries into the exponent when the mantissa overflows: the next
    # binade's first value, which is the right upper neighbour (inf past the largest finite
    # value; inf itself has zero low bits and stays inf).
    result = ((x.view(torch.int32) + noise) & ~(2**bits - 1)).view(torch.float32)
    result = torch.where(torch.isnan(x), x, result)  # a NaN's payload may sit in the low bits
    if dtype == torch.float16:
        dither = (noise.float() + 0.5) * (_FP16_SUBNORMAL_STEP / 2**bits) - (
            _FP16_SUBNORMAL_STEP / 2
        )
        small = x.abs() < _FP16_MIN_NORMAL
        result = torch.where(small, x + dither, result)
    return result.to(dtype)


def _random_bits(shape: torch.Size, bits: int, generator: torch.Generator) -> Tensor:
    """Uniform int32 values below ``2**bits`` (``bits`` <= 16), one per element of ``shape``.

    Drawn as 63-bit words, cut into 16-bit chunks (four per word for up to 15 bits, three for
    16: a word's top bit is always 0), which costs a tenth of one draw per element on CPU.
    """
    count = math.prod(shape)
    per_word = 4 if bits <= 15 else 3
    words = torch.empty(-(-count // per_word), dtype=torch.int64, device=generator.device)
    words.random_(generator=generator)
    shifts = torch.arange(0, 16 * per_word, 16, device=words.device)
    chunks = (words.unsqueeze(1) >> shifts) & (2**bits - 1)
    return chunks.reshape(-1)[:count].to(torch.int32).reshape(shape)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` (CPU or an accelerator) seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
