"""`Backend.AUTO` by measurement: time each candidate backend on a small probe of the real
table shapes on this machine, keep the faster one, and remember it on disk per machine, torch
and fbgemm version and shape class, so later runs pay nothing. fbgemm's CPU kernels differ
20x between x86 VMs for the same shapes (issue 14); no fixed table is right everywhere.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from recopt.kernels.autotune_cache import DecisionCache, machine_key
from recopt.kernels.backends import kernel_class
from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.contract import BackendDecision, Kernel
from recopt.kernels.precision import Precision

logger = logging.getLogger(__name__)

ENV_BACKEND = "RECOPT_BACKEND"
ENV_CACHE_DIR = "RECOPT_CACHE_DIR"
# The probe's largest table: 2**18 rows x dim 64 is 64 MiB, beyond any CPU cache, and an
# fbgemm + recopt probe (4096 bags of 20 ids, a step of ~5 ms) stays well under 2 s on the
# 2-core VM; steps that long average out short scheduling noise on a shared machine.
PROBE_MAX_ROWS = 2**18

# One timing sample of one candidate, in seconds per probe step.
Sampler = Callable[[], float]
# (shape class, optimizer, candidates, config) -> one sampler per candidate.
SamplerFactory = Callable[
    ["ShapeClass", FusedOptimizerConfig, Sequence[Backend], "AutoConfig"], Mapping[Backend, Sampler]
]


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoConfig:
    """How ``Backend.AUTO`` resolves.

    Args:
        pin: ``fbgemm`` or ``recopt`` pins AUTO's answer (reproducible runs; fbgemm only where
            it can run the tables); ``auto`` measures.
        cache_dir: directory of the decision cache file; ``None`` keeps decisions in memory.
        probe_bags: bags per probe step.
        ids_per_bag: ids per bag in the probe.
        repeats: timed steps per candidate (interleaved; the median counts).
    """

    pin: Backend = Backend.AUTO
    cache_dir: Path | None = None
    probe_bags: int = 4096
    ids_per_bag: int = 20
    repeats: int = 7

    def __post_init__(self) -> None:
        object.__setattr__(self, "pin", Backend(self.pin))
        for name in ("probe_bags", "ids_per_bag", "repeats"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"AutoConfig.{name} must be >= 1, got {value}")


def auto_config_from_environment(environ: Mapping[str, str] | None = None) -> AutoConfig:
    """The AUTO settings the environment asks for (the one place recopt reads them).

    ``RECOPT_BACKEND`` = ``fbgemm`` | ``recopt`` | ``auto`` pins AUTO's answer. The cache lives
    in ``RECOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/recopt``, else ``~/.cache/recopt``.

    Raises:
        ValueError: ``RECOPT_BACKEND`` is not a backend name.
    """
    env = os.environ if environ is None else environ
    pin = env.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if pin not in {b.value for b in Backend}:
        raise ValueError(
            f"{ENV_BACKEND}={pin!r} is not a backend; use one of {[b.value for b in Backend]}"
        )
    if env.get(ENV_CACHE_DIR):
        cache_dir = Path(env[ENV_CACHE_DIR])
    else:
        base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        cache_dir = Path(base) / "recopt"
    return AutoConfig(pin=Backend(pin), cache_dir=cache_dir)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeClass:
    """What the ranking of backends depends on; the cache key and the probe's recipe.

    Args:
        device: device type (``cpu``, ``cuda``).
        optimizer: fused optimizer name.
        dim: the tables' most common embedding dim (the larger on a tie).
        rows: the largest table's rows, rounded up to a power of two, capped at the probe's.
        precision: the weights' and state's storage (``fp32``, or e.g. ``fp16`` /
            ``fp16-state-bf16``); fp16 moves fewer bytes, so it is decided separately.
    """

    device: str
    optimizer: str
    dim: int
    rows: int
    precision: str = "fp32"

    @classmethod
    def of(
        cls, tables: Sequence[TableSpec], optimizer: FusedOptimizerConfig, device: torch.device
    ) -> ShapeClass:
        """The class of one kernel's tables."""
        dims = [t.embedding_dim for t in tables]
        dim = max(set(dims), key=lambda d: (dims.count(d), d))
        rows = 2 ** math.ceil(math.log2(max(t.num_embeddings for t in tables)))
        weights = max((Precision(t.weight_dtype) for t in tables), key=lambda p: p.bytes)
        precision = weights.value
        if optimizer.state_dtype != weights:
            precision += f"-state-{optimizer.state_dtype.value}"
        return cls(
            device=device.type,
            optimizer=optimizer.name,
            dim=dim,
            rows=min(rows, PROBE_MAX_ROWS),
            precision=precision,
        )

    @property
    def weight_dtype(self) -> Precision:
        """The probe table's weight precision."""
        return Precision(self.precision.split("-")[0])

    def key(self) -> str:
        """The cache key, e.g. ``cpu/row_wise_adagrad/dim64/rows262144`` (``/fp16`` added
        for reduced precision)."""
        key = f"{self.device}/{self.optimizer}/dim{self.dim}/rows{self.rows}"
        return key if self.precision == "fp32" else f"{key}/{self.precision}"


MIN_REPEATS = 3
# Early stop only for a clear gap: the slowest sample of the fastest candidate times this is
# still below every other candidate's fastest sample.
SEPARATION = 1.5


def measure(samplers: Mapping[Backend, Sampler], repeats: int) -> dict[Backend, float]:
    """Median seconds of each candidate over up to ``repeats`` interleaved samples.

    Interleaving (a, b, a, b, ...) exposes every candidate alike to load that drifts. After
    ``MIN_REPEATS`` rounds, sampling stops once one candidate is clearly ahead (its slowest
    sample times ``SEPARATION`` beats every sample of the others): more would not change the
    ranking, and a slow candidate would cost most of the time.
    """
    samples: dict[Backend, list[float]] = {b: [] for b in samplers}
    for round_ in range(repeats):
        for backend, sample in samplers.items():
            samples[backend].append(sample())
        if round_ + 1 >= MIN_REPEATS and _separated(samples):
            break
    return {b: statistics.median(s) for b, s in samples.items()}


def _separated(samples: Mapping[Backend, list[float]]) -> bool:
    best = min(samples, key=lambda b: max(samples[b]))
    return all(SEPARATION * max(samples[best]) < min(s) for b, s in samples.items() if b != best)


def probe_samplers(
    shape: ShapeClass,
    optimizer: FusedOptimizerConfig,
    candidates: Sequence[Backend],
    config: AutoConfig,
) -> dict[Backend, Sampler]:
    """One sampler per candidate: a fwd + bwd + fused update of a one-table probe.

    The probe has the class's rows and dim, ``config.probe_bags`` bags of
    ``config.ids_per_bag`` uniform ids; each kernel is warmed up once before it is timed.
    """
    device = torch.device(shape.device)
    table = [
        TableSpec(
            name="probe",
            num_embeddings=shape.rows,
            embedding_dim=shape.dim,
            weight_dtype=shape.weight_dtype,
        )
    ]
    gen = torch.Generator().manual_seed(0)
    n = config.probe_bags * config.ids_per_bag
    ids = torch.randint(0, shape.rows, (n,), generator=gen).to(device)
    offsets = torch.arange(0, n + 1, config.ids_per_bag, dtype=torch.int64, device=device)
    grad = torch.ones(config.probe_bags, shape.dim, device=device)
    samplers: dict[Backend, Sampler] = {}
    for backend in candidates:
        opt = dataclasses.replace(optimizer, backend=backend)
        kernel = kernel_class(backend)(table, [0], opt, PoolingType.SUM, device)
        samplers[backend] = _timed_step(kernel, ids, offsets, grad, device)
        samplers[backend]()  # warm-up: first touch of the pages, native library load
    return samplers


def _timed_step(
    kernel: Kernel,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    grad: torch.Tensor,
    device: torch.device,
) -> Sampler:
    def sample() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        kernel(ids, offsets).backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return sample


class AutoResolver:
    """Resolves ``Backend.AUTO`` per shape class: pin, memory, disk cache, then measurement.

    Args:
        config: the AUTO settings.
        sampler_factory: builds the candidates' samplers (tests inject fakes).
        machine: the cache's machine key (default: `machine_key` of this host).
    """

    def __init__(
        self,
        config: AutoConfig,
        sampler_factory: SamplerFactory = probe_samplers,
        machine: str | None = None,
    ) -> None:
        self.config = config
        self._sampler_factory = sampler_factory
        self._machine = machine
        self._memo: dict[str, BackendDecision] = {}
        self._adopted: dict[str, BackendDecision] = {}
        self.measurements = 0  # how many shape classes this resolver has timed

    def _cache(self, device: str) -> DecisionCache | None:
        if self.config.cache_dir is None:
            return None
        return DecisionCache(self.config.cache_dir, self._machine or machine_key(device))

    def resolve(
        self,
        shape: ShapeClass,
        optimizer: FusedOptimizerConfig,
        candidates: Sequence[Backend],
    ) -> BackendDecision:
        """The decision for one shape class among the backends that can run it.

        Args:
            shape: the tables' shape class.
            optimizer: the fused optimizer (its hyperparameters shape the probe's update).
            candidates: the backends able to run the tables (recopt always is).

        Returns:
            The decision; measured at most once per shape class and machine.
        """
        key = shape.key()
        if key in self._adopted and self._adopted[key].backend in candidates:
            return self._adopted[key]
        if self.config.pin is not Backend.AUTO and self.config.pin in candidates:
            return BackendDecision(backend=self.config.pin, reason=f"pinned to {self.config.pin}")
        if len(candidates) == 1:
            return BackendDecision(backend=candidates[0], reason="only candidate")
        if key in self._memo:
            return self._memo[key]
        cache = self._cache(shape.device)
        decision = cache.get(key) if cache is not None else None
        if decision is None:
            decision = self._measure(shape, optimizer, candidates)
            if cache is not None:
                cache.put(key, decision)
        else:
            decision = dataclasses.replace(decision, reason="cached")
            logger.info(
                "Backend.AUTO for %s: %s (cached in %s; probe step: %s)",
                key,
                decision.backend,
                self.config.cache_dir,
                _format_times(decision.seconds),
            )
        self._memo[key] = decision
        return decision

    def _measure(
        self, shape: ShapeClass, optimizer: FusedOptimizerConfig, candidates: Sequence[Backend]
    ) -> BackendDecision:
        if shape.device == "cuda" and not torch.cuda.is_available():
            return BackendDecision(
                backend=Backend.FBGEMM, reason="cuda is not available to measure; fbgemm"
            )
        start = time.perf_counter()
        samplers = self._sampler_factory(shape, optimizer, candidates, self.config)
        try:
            medians = measure(samplers, self.config.repeats)
        finally:
            del samplers  # the probe kernels: freed now, before the next shape class is built
            _collect_garbage(shape.device)
        self.measurements += 1
        best = min(medians, key=lambda b: (medians[b], b.value))
        seconds = {b.value: s for b, s in medians.items()}
        logger.info(
            "Backend.AUTO for %s: %s (probe step: %s; measured in %.2f s)",
            shape.key(),
            best,
            _format_times(seconds),
            time.perf_counter() - start,
        )
        return BackendDecision(backend=best, reason="measured", seconds=seconds)

    def decisions(self) -> dict[str, BackendDecision]:
        """The decisions measured, cached or adopted so far, by shape-class key."""
        return {**self._memo, **self._adopted}

    def adopt(self, decisions: Mapping[str, BackendDecision]) -> None:
        """Take decisions made elsewhere (rank 0's): they win over this process's pin and
        measurements, so every rank runs the same backends."""
        self._adopted.update(decisions)


def _collect_garbage(device: str) -> None:
    """Free what the probes left in reference cycles and, on CUDA, the allocator's cached blocks.

    A probe of a large table holds as much memory as the table: left to the collector, it would
    still be held while the next shape class or the real kernels are built, and the caching
    allocator's blocks are memory other processes sharing the GPU cannot use.
    """
    gc.collect()
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _format_times(seconds: Mapping[str, float]) -> str:
    return ", ".join(f"{b} {s * 1e3:.2f} ms" for b, s in seconds.items())


_default: AutoResolver | None = None


def default_resolver() -> AutoResolver:
    """The process's resolver, built from the environment on first use."""
    global _default
    if _default is None:
        _default = AutoResolver(auto_config_from_environment())
    return _default


def configure_auto(resolver: AutoResolver | AutoConfig | None) -> AutoResolver | None:
    """Replace the process's resolver (entry points, tests); ``None`` re-reads the environment.

    Returns:
        The previous resolver (``None`` if none was built yet).
    """
    global _default
    previous = _default
    _default = AutoResolver(resolver) if isinstance(resolver, AutoConfig) else resolver
    return previous
