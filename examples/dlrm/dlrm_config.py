"""The DLRM example's configuration: a TrainingConfig composing each component's own dataclass.

Components own their sections (``DLRMConfig``, ``EmbeddingBagConfig``, ``FusedOptimizerConfig``,
``SyntheticConfig``, ``WarmupStage``, the planner's topology); the sections that only this
script uses (loop, dense optimizer, clipping, checkpoints) are defined here. ``load_config``
reads a TOML file, applies ``--set key=value`` overrides and rejects any unknown key by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm_data import data_source

from recopt.config import apply_overrides, from_dict, load_toml, merge, to_plain
from recopt.data import SyntheticConfig
from recopt.ft import replica_sync_optimizer
from recopt.kernels import FusedOptimizerConfig, Placement
from recopt.kernels.precision import Precision, parse_precision
from recopt.models import DLRMConfig
from recopt.modules import EmbeddingBagConfig, IdMapConfig
from recopt.optim.clipping import GradientClipping
from recopt.optim.warmup import WarmupPolicy, WarmupStage
from recopt.sharding.planner.constraints import placement_from_value

DENSE_OPTIMIZERS = ("adagrad", "adam", "sgd")
MATMUL_PRECISIONS = ("highest", "high", "medium")
# training.num_threads above this many per core only oversubscribes (and a huge count crashed
# torch's thread pool with a segfault).
MAX_THREADS_PER_CORE = 4


def default_tables() -> tuple[EmbeddingBagConfig, ...]:
    """The built-in small model's tables: 8 features, 500 to 20k rows, dim 16."""
    rows = [20_000, 10_000, 5_000, 2_000, 1_000, 1_000, 500, 500]
    return tuple(
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=n, embedding_dim=16, feature_names=(f"cat_{i}",)
        )
        for i, n in enumerate(rows)
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingSection:
    """``[embedding]``: the ``[[embedding.tables]]``, their fused ``[embedding.optimizer]`` and
    ``[embedding.placements]``: table name -> where it lives on a GPU, ``"device"``, ``"uvm"``,
    ``"uvm_caching"`` or ``{location = "uvm_caching", cache_load_factor = 0.1}``. Tables not
    named: the planner chooses on several ranks, device memory on one. UVM needs CUDA.

    ``weight_dtype`` (``fp32``, ``fp16``, ``bf16``) is every table's weight dtype unless the
    table sets its own ``weight_dtype``; the optimizer's ``state_dtype`` sets its state's.
    ``id_map`` (e.g. ``{ policy = "lru" }``) makes every table without its own ``id_map``
    an id-mapped table (raw ids, each its own row, with eviction: docs/id_map.md).
    """

    tables: tuple[EmbeddingBagConfig, ...] = field(default_factory=default_tables)
    optimizer: FusedOptimizerConfig = field(
        default_factory=lambda: FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05)
    )
    placements: dict[str, Any] = field(default_factory=dict)
    weight_dtype: Precision = Precision.FP32
    id_map: IdMapConfig | None = None

    def __post_init__(self) -> None:
        dtype = parse_precision(self.weight_dtype, "embedding.weight_dtype")
        object.__setattr__(self, "weight_dtype", dtype)
        if not self.tables:
            raise ValueError("embedding.tables is empty; the model needs at least one table")
        readers: dict[str, list[str]] = {}
        for t in self.tables:
            for feature in t.feature_names:
                readers.setdefault(feature, []).append(t.name)
        shared = {f: names for f, names in readers.items() if len(names) > 1}
        if shared:
            raise ValueError(
                f"embedding.tables: features read by several tables {shared}; each table of "
                "the DLRM script reads its own categorical feature (the data makes one per "
                "feature name)"
            )
        names = [t.name for t in self.tables]
        unknown = sorted(set(self.placements) - set(names))
        if unknown:
            raise ValueError(
                f"embedding.placements names tables {unknown} that are not in "
                f"[[embedding.tables]] (tables: {names}); use a table's name"
            )
        resolved: dict[str, Placement] = {}
        for name, value in self.placements.items():
            try:
                resolved[name] = placement_from_value(value)
            except ValueError as e:
                raise ValueError(
                    f'embedding.placements.{name} = {value!r}: {e}; e.g. "uvm_caching" or '
                    '{location = "uvm_caching", cache_load_factor = 0.2}'
                ) from None
        object.__setattr__(self, "placements", resolved)


@dataclass(frozen=True, kw_only=True, slots=True)
class DenseOptimizerConfig:
    """``[dense_optimizer]``: the torch optimizer of the MLPs (``adagrad``, ``adam``, ``sgd``)."""

    name: str = "adagrad"
    lr: float = 0.02
    eps: float = 1e-8
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    def __post_init__(self) -> None:
        if self.name not in DENSE_OPTIMIZERS:
            raise ValueError(
                f"dense_optimizer.name {self.name!r} is unknown; use one of {DENSE_OPTIMIZERS}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(
                f"dense_optimizer.lr must be finite and > 0, got {self.lr}; e.g. lr=0.02"
            )
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"dense_optimizer.eps must be finite and > 0, got {self.eps}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(
                f"dense_optimizer.weight_decay must be finite and >= 0, got {self.weight_decay}"
            )
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(
                f"dense_optimizer.betas must each be in [0, 1), got {list(self.betas)}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupSection:
    """``[warmup]``: LR stages applied to both optimizers, each relative to its own base lr."""

    stages: tuple[WarmupStage, ...] = (
        WarmupStage(policy=WarmupPolicy.LINEAR, max_iters=100, value=0.1),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ClippingSection:
    """``[clipping]``: gradient clipping of the dense parameters (``none``, ``norm``, ``value``)."""

    clipping: GradientClipping = GradientClipping.NORM
    max_gradient: float = 10.0
    norm_type: float = 2.0

    def __post_init__(self) -> None:
        if not (self.max_gradient >= 0 and math.isfinite(self.max_gradient)):
            raise ValueError(
                f"clipping.max_gradient must be finite and >= 0, got {self.max_gradient}; e.g. 10.0"
            )
        if not self.norm_type > 0:  # inf is valid: the max norm
            raise ValueError(
                f"clipping.norm_type must be > 0 (or inf for the max norm), got {self.norm_type}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class CriteoSection:
    """``[data.criteo]``: TSV files of the training and validation streams."""

    train_paths: tuple[str, ...] = ()
    val_paths: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSection:
    """``[data]``: the source, the per-rank batch size and the validation size."""

    source: str = "synthetic"
    batch_size: int = 512
    val_batches: int = 8
    synthetic: SyntheticConfig = field(
        default_factory=lambda: SyntheticConfig(min_ids_per_bag=1, max_ids_per_bag=3)
    )
    criteo: CriteoSection = field(default_factory=CriteoSection)

    def __post_init__(self) -> None:
        data_source(self.source)  # an unknown source is an error listing the known ones
        if self.batch_size < 1 or self.val_batches < 0:
            raise ValueError(
                f"data.batch_size ({self.batch_size}) must be >= 1 and data.val_batches "
                f"({self.val_batches}) >= 0"
            )
        if self.source == "criteo" and not self.criteo.train_paths:
            raise ValueError("data.source is 'criteo' but data.criteo.train_paths is empty")
        if self.source == "criteo":  # all of them now, not when the stream reaches one
            for key in ("train_paths", "val_paths"):
                for path in getattr(self.criteo, key):
                    if not Path(path).is_file():
                        raise ValueError(f"data.criteo.{key}: {path!r} is not a readable file")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopSection:
    """``[training]``: steps, logging, validation cadence, seed, outputs, threads, timeouts.

    ``epochs`` is the number of passes over a finite (Criteo) training set; training ends at
    ``steps`` or at the end of the last pass, whichever comes first (the synthetic stream is
    endless, so only ``steps`` ends it).

    ``num_threads`` 0 (default) gives each rank its share of the machine's cores (cores /
    local ranks); on a machine shared with other busy processes 1 can be much faster, since
    idle-spinning intra-op threads starve each other (measured: 69k vs 1.1k samples/s on 2
    loaded cores), while on an idle 2-core machine 2 threads beat 1 (small config 113k vs
    90k samples/s).
    ``max_consecutive_nonfinite``: stop with an error after this many steps in a row whose
    loss or gradient was NaN/inf (each is skipped: nothing is updated); 0 never stops.
    ``pipeline``: train with recopt's TrainPipelineSparseDist (batch i+1's ids distributed
    and batch i+2 copied during batch i's step; the same result; its phase times are logged
    as ``pipeline_<phase>_ms``, with id maps also ``pipeline_remap_worker_ms``, the remap
    worker's time a step); false: the plain loop. ``remap_threads``: threads of the native
    remap that the pipeline's worker runs for an unsharded model's id maps (default 1; more
    where cores are free beside the step, e.g. a GPU host: the maps live on the host).
    ``timeout_s`` bounds every collective. ``matmul_precision`` is torch's float32 matmul
    precision: ``highest`` (exact fp32), or ``medium`` (bfloat16 products where torch calls
    MKL/oneDNN matmul; see docs/dlrm.md for what it gains next to ``model.use_onednn``).
    """

    steps: int = 1500
    epochs: int = 1
    log_every: int = 50
    eval_every: int = 250
    seed: int = 0
    output_dir: str = "runs/dlrm_small"
    num_threads: int = 0
    timeout_s: float = 300.0
    plot: bool = True
    matmul_precision: str = "highest"
    max_consecutive_nonfinite: int = 5
    pipeline: bool = True
    remap_threads: int = 1

    def __post_init__(self) -> None:
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"training.matmul_precision {self.matmul_precision!r} is unknown; use one of "
                f"{MATMUL_PRECISIONS}"
            )
        for name, low, hint in (
            ("steps", 1, ""),
            ("epochs", 1, ""),
            ("log_every", 1, ""),
            ("eval_every", 0, "; 0 evaluates only at the end"),
            ("num_threads", 0, "; 0 gives each rank its share of the cores"),
            ("max_consecutive_nonfinite", 0, "; 0 never stops on NaN/inf steps"),
            ("remap_threads", 1, ""),
        ):
            if getattr(self, name) < low:
                raise ValueError(
                    f"training.{name} must be >= {low}, got {getattr(self, name)}{hint}"
                )
        most_threads = MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
        if self.num_threads > most_threads:
            raise ValueError(
                f"training.num_threads {self.num_threads} is more than {MAX_THREADS_PER_CORE} "
                f"per core of this machine's {os.cpu_count()} cores; use at most {most_threads}, "
                "or 0 to give each rank its share of the cores"
            )
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(
                f"training.timeout_s must be finite and > 0 (seconds each collective may take), "
                f"got {self.timeout_s}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSection:
    """``[checkpoint]``: save every ``every`` steps (0: never) under ``dir`` (or output_dir)."""

    every: int = 500
    dir: str = ""
    keep: int = 2

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(
                f"checkpoint.every must be >= 0 (steps between saves, 0: never), got {self.every}"
            )
        if self.keep < 1:
            raise ValueError(
                f"checkpoint.keep must be >= 1 (complete checkpoints kept), got {self.keep}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultToleranceSection:
    """``[fault_tolerance]``, read only under ``--fault-tolerant`` (docs/fault_tolerance.md).

    The first quorum waits for the groups torchft's lighthouse was started for
    (``torchft_lighthouse --min_replicas N``). ``sync_embeddings``: keep the fused tables
    identical across replica groups (row gradients averaged in the kernel's ``grad_hook``;
    the ``auto`` backend then becomes ``recopt``, whose kernels have the hook); false lets
    each group train its own tables. ``timeout_s`` bounds every cross-replica collective,
    vote, quorum and healing transfer. A dropped step retries its batch (the data position
    does not advance), backing off; ``max_consecutive_failures`` dropped steps in a row stop
    the run with the last cause. A step dropped for a NaN/inf loss or gradient skips its
    batch instead (retrying it would fail again) and counts as a non-finite step.
    """

    sync_embeddings: bool = True
    timeout_s: float = 60.0
    max_consecutive_failures: int = 50

    def __post_init__(self) -> None:
        if self.max_consecutive_failures < 1:
            raise ValueError(
                "fault_tolerance.max_consecutive_failures must be >= 1 (dropped steps in a row "
                f"before the run stops), got {self.max_consecutive_failures}"
            )
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(
                f"fault_tolerance.timeout_s must be finite and > 0, got {self.timeout_s}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """The whole run: one field per TOML section."""

    model: DLRMConfig = field(default_factory=DLRMConfig)
    embedding: EmbeddingSection = field(default_factory=EmbeddingSection)
    dense_optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    warmup: WarmupSection = field(default_factory=WarmupSection)
    clipping: ClippingSection = field(default_factory=ClippingSection)
    data: DataSection = field(default_factory=DataSection)
    training: LoopSection = field(default_factory=LoopSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    fault_tolerance: FaultToleranceSection = field(default_factory=FaultToleranceSection)
    # The planner's Topology fields (world_size comes from the launcher; without `device`, the
    # run's device, its memory measured on CUDA: dlrm_build.planning_topology). Empty by
    # default, so that only the fields a config sets override what is measured.
    planner: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        dense = 13 if self.data.source == "criteo" else self.data.synthetic.num_dense
        if self.model.dense_in_features != dense:
            source = "Criteo's" if self.data.source == "criteo" else "data.synthetic.num_dense"
            raise ValueError(
                f"model.dense_in_features ({self.model.dense_in_features}) must equal the "
                f"data's dense columns ({source}: {dense})"
            )


def load_config(path: str | None, overrides: Sequence[str] = ()) -> TrainingConfig:
    """Reads ``path`` (or the built-in defaults when None) and applies the overrides.

    Args:
        path: a TOML file.
        overrides: ``section.key=value`` strings (values read as TOML, else as strings).

    Returns:
        The validated config.

    Raises:
        ValueError: an unreadable file, a malformed override, an unknown key (named), or an
            invalid value (the owning dataclass's message).
    """
    # Defaults first, so an override can reach a default list (embedding.tables.0.name=...).
    data = to_plain(TrainingConfig())
    from_file = load_toml(path) if path is not None else {}
    data = apply_overrides(merge(data, from_file), overrides)
    _registry_defaults_for_another_optimizer(data, from_file, overrides)
    _section_weight_dtype(data, from_file, overrides)
    _section_id_map(data)
    where = path or "defaults"
    try:
        config = from_dict(TrainingConfig, data, "")
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    _check_planner(config.planner, where)
    return config


def _registry_defaults_for_another_optimizer(
    data: dict[str, Any], from_file: dict[str, Any], overrides: Sequence[str]
) -> None:
    """An ``[embedding.optimizer]`` that names another optimizer than the script's row-wise
    Adagrad, without setting ``lr``/``eps`` itself, gets that optimizer's reference defaults
    (the registry's): ``name = "adam"`` alone means SparseAdam's lr 1e-3, not 0.05."""
    chosen = data["embedding"]["optimizer"]
    if chosen.get("name") == EmbeddingSection().optimizer.name:
        return
    in_file = from_file.get("embedding", {}).get("optimizer", {})
    for key in ("lr", "eps"):
        overridden = any(o.startswith(f"embedding.optimizer.{key}=") for o in overrides)
        if key not in in_file and not overridden:
            chosen.pop(key, None)


def _section_weight_dtype(
    data: dict[str, Any], from_file: dict[str, Any], overrides: Sequence[str]
) -> None:
    """``embedding.weight_dtype`` reaches every table that does not set its own (in the file
    or by ``--set embedding.tables.N.weight_dtype=...``)."""
    section = data["embedding"]
    dtype = parse_precision(section.get("weight_dtype", "fp32"), "embedding.weight_dtype").value
    file_tables = from_file.get("embedding", {}).get("tables", [])
    for i, table in enumerate(section.get("tables", [])):
        in_file = i < len(file_tables) and "weight_dtype" in file_tables[i]
        overridden = any(o.startswith(f"embedding.tables.{i}.weight_dtype=") for o in overrides)
        if isinstance(table, dict) and not (in_file or overridden):
            table["weight_dtype"] = dtype


def _section_id_map(data: dict[str, Any]) -> None:
    """``embedding.id_map`` reaches every table that has no ``id_map`` of its own."""
    section = data["embedding"]
    chosen = section.get("id_map")
    if chosen is None:
        return
    for table in section.get("tables", []):
        if isinstance(table, dict) and table.get("id_map") is None:
            table["id_map"] = dict(chosen) if isinstance(chosen, dict) else chosen


def _check_planner(values: dict[str, Any], where: str) -> None:
    """The ``[planner]`` keys are the planner's Topology fields; reject others early."""
    from recopt.sharding.planner.topology import topology_fields

    unknown = sorted(set(values) - topology_fields())
    if unknown:
        raise ValueError(
            f"{where}: unknown config key {', '.join('planner.' + k for k in unknown)}; "
            f"valid keys in [planner]: {sorted(topology_fields())}"
        )


def fault_tolerant_config(config: TrainingConfig) -> TrainingConfig:
    """With ``sync_embeddings``, the ``auto`` kernel backend becomes ``recopt`` (its kernels
    have the ``grad_hook`` that averages row gradients across replica groups)."""
    optimizer = replica_sync_optimizer(
        config.embedding.optimizer, config.fault_tolerance.sync_embeddings
    )
    if optimizer == config.embedding.optimizer:
        return config
    embedding = dataclasses.replace(config.embedding, optimizer=optimizer)
    return dataclasses.replace(config, embedding=embedding)


def parse_args(argv: list[str] | None, description: str | None) -> argparse.Namespace:
    """The training script's command line (``description``: its help text)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", help="TOML config (default: the built-in small config)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set training.steps=100 (repeatable)",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="PATH",
        help="continue from the newest finite checkpoint of the run's checkpoint directory, or "
        "of PATH: a step folder (e.g. recopt-reshard's output) or a checkpoints folder",
    )
    parser.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="start afresh in a checkpoint directory holding another run's checkpoints "
        "(deleted after this run's first checkpoint)",
    )
    parser.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="run as one replica group of a fault-tolerant job on torchft (needs the extra "
        "recopt[ft], TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and torchrun; see "
        "docs/fault_tolerance.md)",
    )
    return parser.parse_args(argv)
