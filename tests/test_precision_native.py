"""The native CPU pass with fp16/bf16 weights and optimizer state, stochastic and nearest rounding.

Tiers: the rounding routines alone (against torch's conversion, and across the vector widths
the C source compiles to), then one pass against references: the torch path (bit-exact where
both paths' float32 arithmetic is exact), the native float32 pass on the same values (any
inputs: the reduced pass is that, rounded), the law of stochastic rounding over many updates,
and the thread count, which must not change a result.
"""

from __future__ import annotations

import ctypes
import math
import platform
import subprocess

import pytest
import torch

from recopt.kernels import cpu_fused, registry
from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.precision import Precision
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

Tensor = torch.Tensor
CPU = torch.device("cpu")
REDUCED = [torch.float16, torch.bfloat16]
ROW_OPTIMIZERS = [n for n, s in registry.OPTIMIZERS.items() if s.c_code is not None]  # native
ROUNDING = [pytest.param(True, id="stochastic"), pytest.param(False, id="nearest")]

pytestmark = pytest.mark.skipif(
    not cpu_fused.available(), reason="no C compiler: the native pass is not built"
)


def _bits(x: Tensor) -> Tensor:
    """The 16-bit patterns of fp16/bf16 values, NaNs all mapped to one pattern."""
    return torch.where(torch.isnan(x), torch.full_like(x, math.nan), x).view(torch.int16)


def _neighbours(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per element of float32 ``x``, the ``dtype`` values ``lo <= x <= hi`` (as float32)."""
    near = x.to(dtype)
    down, up = near.new_tensor(-math.inf), near.new_tensor(math.inf)
    lo = torch.where(near.float() <= x, near, torch.nextafter(near, down))
    hi = torch.where(near.float() >= x, near, torch.nextafter(near, up))
    return lo.float(), hi.float()


# Rounding routines ---------------------------------------------------------------------------


def _probe(dtype: torch.dtype) -> Tensor:
    """Float32 values that exercise every branch of rounding to ``dtype``.

    Every finite value of the dtype, the midpoints of neighbours (ties: round to even) and one
    float32 step either side of each, fp16 subnormals, overflow, inf, NaN, fp32 subnormals
    and random values over 16 decades.
    """
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = patterns.float()
    values = values[torch.isfinite(values)].unique()
    mids = ((values[:-1].double() + values[1:].double()) / 2).float()
    inf = torch.tensor(math.inf)
    gen = torch.Generator().manual_seed(0)
    scales = 10.0 ** torch.empty(100_000).uniform_(-10, 6, generator=gen)
    special = torch.tensor(
        [math.inf, -math.inf, math.nan, -math.nan, 0.0, -0.0, 65504.0, 65519.99, 65520.0]
        + [3.4e38, -3.4e38, 1e-45, -1e-45, 1.2e-38, 2.0**-25, 2.0**-24 * 1.5]
    )
    return torch.cat(
        [
            values,
            mids,
            torch.nextafter(mids, inf),
            torch.nextafter(mids, -inf),
            torch.randn(100_000, generator=gen) * scales,
            special,
        ]
    )


def _libraries() -> dict[str, ctypes.CDLL]:
    """The builds this CPU can run: native, scalar x86-64 and AVX2 + F16C (x86-64-v3).

    A build the compiler cannot make (an old GCC without ``x86-64-v3``) is left out.
    """
    marches = ["native"]
    if platform.machine() in ("x86_64", "AMD64"):
        marches.append("x86-64")
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            marches.append("x86-64-v3")
    libraries = {}
    for march in marches:
        try:
            libraries[march] = cpu_fused._build(march)
        except subprocess.CalledProcessError:
            assert march != "native"
    return libraries


def _round_with(library: ctypes.CDLL, x: Tensor, dtype: torch.dtype, seed: int | None) -> Tensor:
    out = torch.empty(x.shape, dtype=dtype)
    status = library.recopt_round(
        x.numel(),
        x.data_ptr(),
        out.data_ptr(),
        cpu_fused.weight_kind(dtype),
        int(seed is not None),
        seed or 0,
        2,
    )
    assert status == 0
    return out


@pytest.mark.parametrize("dtype", REDUCED)
def test_native_rounding_to_nearest_equals_torch_on_every_vector_width(dtype: torch.dtype) -> None:
    x = _probe(dtype)
    expected = _bits(x.to(dtype))
    torch.testing.assert_close(_bits(cpu_fused.round_to(x, dtype, None)), expected, rtol=0, atol=0)
    for march, library in _libraries().items():
        got = _bits(_round_with(library, x, dtype, None))
        assert torch.equal(got, expected), march


@pytest.mark.parametrize("dtype", REDUCED)
def test_native_stochastic_rounding_is_the_same_on_every_vector_width(dtype: torch.dtype) -> None:
    x = _probe(dtype)
    results = {
        march: _bits(_round_with(library, x, dtype, 12345))
        for march, library in _libraries().items()
    }
    for march, got in results.items():
        assert torch.equal(got, results["native"]), march
    lo, hi = _neighbours(x, dtype)
    rounded = results["native"].view(dtype).float()
    finite = torch.isfinite(x)
    assert torch.all((rounded == lo) | (rounded == hi) | ~finite)
    assert torch.equal(torch.isnan(rounded), torch.isnan(x))


def test_native_pass_refuses_what_it_cannot_store() -> None:
    with pytest.raises(ValueError, match="round_to: dtype torch.float32"):
        cpu_fused.round_to(torch.zeros(3), torch.float32, None)
    with pytest.raises(ValueError, match="stores float32, float16 or bfloat16, not torch.float64"):
        cpu_fused.round_to(torch.zeros(3), torch.float64, 0)
    weight = torch.zeros(4, 2, dtype=torch.float16)
    words = torch.tensor([1 << 32], dtype=torch.int64)  # key 1, gradient offset 0

    def update(code: int, state: tuple[Tensor | None, Tensor | None]) -> None:
        tables = [(weight, *state)]
        cpu_fused.fused_update(
            code, words, None, torch.zeros(1, 2), [0, 4], tables, [0.1] * 6, [0.1]
        )

    with pytest.raises(ValueError, match=r"shape \(3, 2\) for a table of 4 rows"):
        update(1, (torch.zeros(3, 2, dtype=torch.bfloat16), None))
    with pytest.raises(ValueError, match="code 3 needs state tensors not passed"):
        update(3, (torch.zeros(4, 2), None))
    with pytest.raises(ValueError, match="optimizer code 9 has no case in update_row"):
        update(9, (None, None))
    # A state narrower or wider than the code updates would be written past its rows.
    row_state = torch.zeros(4)
    with pytest.raises(ValueError, match=r"code 3 got state of \[\[2, 1\]\] values a row"):
        update(3, (torch.zeros(4, 2), row_state))  # adam's [R, D] second moment given as [R]
    with pytest.raises(ValueError, match=r"code 2 got state of \[\[2, 0\]\]"):
        update(2, (torch.zeros(4, 2), None))  # row-wise adagrad's [R] state given as [R, D]
    with pytest.raises(ValueError, match=r"code 1 got state of \[\[3, 0\]\]"):
        update(1, (torch.zeros(4, 3), None))
    assert torch.equal(row_state, torch.zeros(4)) and torch.equal(weight, torch.zeros(4, 2))
    update(3, (torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.bfloat16)))  # slots' own dtypes


# One pass against references ------------------------------------------------------------------


def _kernel(
    name: str,
    weights: str,
    state: str,
    stochastic: bool = True,
    native: bool = True,
    rows: int = 64,
    dim: int = 8,
    **optimizer: object,
) -> RecoptTableBatchedEmbedding:
    spec = TableSpec(name="t", num_embeddings=rows, embedding_dim=dim, weight_dtype=weights)
    config = FusedOptimizerConfig(
        name=name, state_dtype=state, stochastic_rounding=stochastic, **optimizer
    )
    return RecoptTableBatchedEmbedding([spec], [0], config, PoolingType.SUM, CPU, use_native=native)


def _slots(kernel: RecoptTableBatchedEmbedding) -> dict[str, Tensor]:
    """The table's weights and float state tensors, by name."""
    state = {k: v for k, v in kernel.split_optimizer_states()[0].items() if v.is_floating_point()}
    return {"weight": kernel.split_embedding_weights()[0], **state}


def _load(kernel: RecoptTableBatchedEmbedding, values: dict[str, Tensor]) -> None:
    """Copy ``values`` into the kernel's slots of those names (converted to their dtypes)."""
    with torch.no_grad():
        for name, tensor in _slots(kernel).items():
            if name in values:
                tensor.copy_(values[name])


# Inputs on which both paths' float32 arithmetic is exact up to each formula's last rounding
# (then the reduced results must agree bit for bit): 32 distinct rows, one per bag; row r's
# gradient is +-c_r in every column (c_r a power of two); the learning rate and Adam's step
# size (betas (0.5, 0): lr * sqrt(1 - 0) / (1 - 0.5) = 2 lr) are powers of two, so the
# paths' different association of products (lr * g / d against lr * (g / d)) does not
# matter; and every square root is of a perfect square (torch's float32 sqrt is not always
# correctly rounded: sqrt(5.4453125) is one unit off), with beta2 = 0 for Adam, and Adagrad's
# statistic starting at k^2 - c_r^2 for k = c_r * j / 8.
EXACT = {"lr": 2.0**-4, "betas": (0.5, 0.0)}


def _exact_case(
    name: str, weights: torch.dtype, state: torch.dtype
) -> tuple[dict[str, Tensor], Tensor, Tensor, Tensor]:
    """Start values (representable in their dtypes), ids, offsets and gradient."""
    gen = torch.Generator().manual_seed(3)
    magnitude_R = 2.0 ** torch.randint(-1, 2, (64, 1), generator=gen).float()
    values = {"weight": torch.randn(64, 8, generator=gen).to(weights).float()}
    for slot, tensor in _slots(_kernel(name, "fp32", "fp32", native=False)).items():
        if slot == "momentum1":  # k^2 - c^2: k and j need few bits, so fp16 and bf16 hold it
            j = torch.randint(9, 17, tensor.shape, generator=gen).float()
            c = magnitude_R if tensor.dim() == 2 else magnitude_R[:, 0]
            values[slot] = (c * c * (j * j - 64) / 64).to(state).float()
        elif slot in ("exp_avg", "exp_avg_sq"):  # magnitudes in [2^-6, 2]: sums stay exact
            value = torch.rand(tensor.shape, generator=gen) * 2 + 2.0**-6
            sign = torch.randint(0, 2, tensor.shape, generator=gen) * 2 - 1
            values[slot] = (value * (sign if slot == "exp_avg" else 1)).to(state).float()
    ids = torch.randperm(64, generator=gen)[:32]
    sign = torch.randint(0, 2, (32, 8), generator=gen) * 2 - 1
    return values, ids, torch.arange(33), sign * magnitude_R[ids]


@pytest.mark.parametrize("stochastic", ROUNDING)
@pytest.mark.parametrize("state", ["fp16", "bf16"])
@pytest.mark.parametrize("reduced_weights", [True, False], ids=["reduced_weights", "fp32_weights"])
@pytest.mark.parametrize("name", ROW_OPTIMIZERS)
def test_native_reduced_step_matches_the_torch_path(
    name: str, reduced_weights: bool, state: str, stochastic: bool
) -> None:
    weights = state if reduced_weights else "fp32"
    native = _kernel(name, weights, state, stochastic, **EXACT)
    torch_path = _kernel(name, weights, state, stochastic, native=False, **EXACT)
    reference = _kernel(name, "fp32", "fp32", native=False, **EXACT)
    start, ids, offsets, grad = _exact_case(name, Precision(weights).dtype, Precision(state).dtype)
    for kernel in (native, torch_path, reference):
        _load(kernel, start)
        kernel(ids, offsets).backward(grad)
    assert native._native_ok(grad, ids, offsets, None)
    ours, theirs, fp32 = _slots(native), _slots(torch_path), _slots(reference)
    for slot, got in ours.items():
        assert got.dtype == theirs[slot].dtype
        if not stochastic or got.dtype == torch.float32:
            # Rounded to nearest even, as torch's conversion (or float32): bit-exact.
            assert torch.equal(got.view(torch.int16), theirs[slot].view(torch.int16)), slot
            assert torch.equal(got.view(torch.int16), fp32[slot].to(got.dtype).view(torch.int16))
            continue
        lo, hi = _neighbours(fp32[slot], got.dtype)
        assert torch.all((got.float() == lo) | (got.float() == hi)), slot
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[ids] = False
        rows_of = got.view(got.shape[0], -1)
        assert torch.equal(rows_of[untouched].float(), start[slot].view(64, -1)[untouched])


@pytest.mark.parametrize("stochastic", ROUNDING)
@pytest.mark.parametrize("state", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ROW_OPTIMIZERS)
def test_native_reduced_pass_is_the_fp32_pass_rounded(
    name: str, state: str, stochastic: bool
) -> None:
    # Any inputs (repeated ids, three steps, adam's bias correction): each step starts the
    # native float32 pass from the reduced kernel's values; the same C arithmetic, so the
    # reduced results are its results rounded (to nearest: torch's conversion; stochastic:
    # one of the two neighbours, so within one unit in the last place).
    native = _kernel(name, state, state, stochastic, rows=200, dim=12, lr=0.05)
    reference = _kernel(name, "fp32", "fp32", rows=200, dim=12, lr=0.05)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        _load(reference, {k: v.float() for k, v in _slots(native).items()})
        ids = torch.randint(0, 200, (300,), generator=gen)
        offsets = torch.arange(0, 301, 3)
        grad = torch.randn(100, 12, generator=gen) * 3
        for kernel in (native, reference):
            kernel(ids, offsets).backward(grad)
        for slot, got in _slots(native).items():
            want = _slots(reference)[slot]
            if stochastic:
                lo, hi = _neighbours(want, got.dtype)
                assert torch.all((got.float() == lo) | (got.float() == hi)), slot
            else:
                assert torch.equal(_bits(got), _bits(want.to(got.dtype))), slot


# The state slots with one value per row (the others have one per element).
ROW_SLOTS = {("row_wise_adagrad", "momentum1"), ("row_wise_adam", "exp_avg_sq")}


def _expected_state(name: str, slot: str, steps: int, grad: float, one_minus: float) -> float:
    """A state slot's value after ``steps`` updates from 1.0 in exact arithmetic (from the
    float32 gradient, its float32 square and the pass's float32 ``1 - beta``)."""
    g = float(torch.tensor(grad))
    g_sq = float(torch.tensor(grad) * torch.tensor(grad))
    value = 1.0
    for _ in range(steps):
        if name in ("adagrad", "row_wise_adagrad"):
            value += g_sq
        else:
            value += ((g if slot == "exp_avg" else g_sq) - value) * one_minus
    return value


@pytest.mark.parametrize("state", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["adagrad", "row_wise_adagrad", "adam", "row_wise_adam"])
def test_native_state_rounding_is_unbiased_over_many_updates(name: str, state: str) -> None:
    # Every step adds about 1e-4 to state values near 1.0, under half a unit in the last place
    # of both dtypes there: rounding to nearest keeps 1.0 for ever; stochastic rounding adds
    # them up on average.
    rows, dim, steps, grad = 8192, 8, 200, 0.01 if "adagrad" in name else 2.0
    betas = (0.9999, 0.9999)
    one_minus = float(torch.tensor(1.0 - betas[0]))  # the pass's float32 1 - beta
    ids, offsets = torch.arange(rows), torch.arange(rows + 1)
    means: dict[bool, dict[str, float]] = {}
    for stochastic in (True, False):
        kernel = _kernel(name, "fp32", state, stochastic, rows=rows, dim=dim, betas=betas)
        with torch.no_grad():
            for slot, tensor in _slots(kernel).items():
                if slot != "weight":
                    tensor.fill_(1.0)
        for _ in range(steps):
            kernel(ids, offsets).backward(torch.full((rows, dim), grad))
        means[stochastic] = {
            slot: t.double().mean().item() for slot, t in _slots(kernel).items() if slot != "weight"
        }
    ulp = 2.0 ** (-10 if state == "fp16" else -7)  # the spacing in [1, 2), where values stay
    for slot, mean in means[True].items():
        values = rows * dim if (name, slot) not in ROW_SLOTS else rows
        # Each step's rounding error has variance <= ulp^2 / 4 and later steps only shrink it
        # (x -> x + (target - x) * (1 - beta)); the mean of `values` independent elements.
        bound = 5 * math.sqrt(steps) * (ulp / 2) / math.sqrt(values)
        expected = _expected_state(name, slot, steps, grad, one_minus)
        assert abs(mean - expected) < bound, (slot, mean, expected, bound)
        assert means[False][slot] == 1.0  # to nearest: every update lost
        assert abs(expected - 1.0) > 3 * bound  # so the test tells the two apart


@pytest.mark.parametrize("stochastic", ROUNDING)
@pytest.mark.parametrize("state", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ROW_OPTIMIZERS)
def test_native_reduced_results_do_not_depend_on_the_thread_count(
    name: str, state: str, stochastic: bool
) -> None:
    # 40,000 ids: the pass splits them into many chunks with 2 threads, one with 1 thread.
    def run(threads: int) -> dict[str, Tensor]:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kernel = _kernel(name, state, state, stochastic, rows=5000, dim=16, lr=0.05)
            gen = torch.Generator().manual_seed(6)
            _load(kernel, {"weight": torch.randn(5000, 16, generator=gen)})
            for _ in range(2):
                ids = torch.randint(0, 5000, (40_000,), generator=gen)
                grad = torch.randn(8000, 16, generator=gen)
                kernel(ids, torch.arange(0, 40_001, 5)).backward(grad)
            return _slots(kernel)
        finally:
            torch.set_num_threads(previous)

    one, two = run(1), run(2)
    for slot, tensor in one.items():
        assert torch.equal(_bits(tensor), _bits(two[slot])), slot
