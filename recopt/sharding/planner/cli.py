"""`recopt-plan`: plan a model config's embedding tables, or calibrate this machine's topology.

`recopt-plan CONFIG --world-size N [--topology FILE] [--output plan.json]` reads the config's
`[[embedding.tables]]` (``unpooled = true``: an EmbeddingCollection's table; with
`[embedding]`'s `weight_dtype` for tables that set none),
`[embedding.optimizer]` and `[planner]` (other sections are ignored);
topology values come from `[planner]`, then the file, then flags. `--calibrate` measures instead.
A plan that puts tables in UVM (cuda topologies) is followed by why and its estimated cost.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass, field
from typing import Any

from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, IdMapConfig
from recopt.sharding.planner.constraints import (
    ParameterConstraints,
    constraints_from_dict,
    optimizer_from_dict,
)
from recopt.sharding.planner.planner import EmbeddingShardingPlanner, PlannerError
from recopt.sharding.planner.stats import format_bytes
from recopt.sharding.planner.topology import (
    Topology,
    load_topology_values,
    topology_fields,
    topology_from_dict,
)

TABLE_KEYS = set(EmbeddingBagConfig.__dataclass_fields__) | {"unpooled"}
UNPOOLED_KEYS = set(EmbeddingConfig.__dataclass_fields__) | {"unpooled"}
PLANNER_KEYS = {"batch_size", "module_path", "max_search_trials", "constraints"}


class ConfigError(ValueError):
    """The model config cannot be planned: a key or value is wrong; the message names it."""


@dataclass(kw_only=True, slots=True)
class PlannerInput:
    """What `recopt-plan` reads from a model config."""

    tables: list[BaseEmbeddingConfig]
    optimizer: FusedOptimizerConfig | None = None
    topology: dict[str, Any] = field(default_factory=dict)
    constraints: dict[str, ParameterConstraints] = field(default_factory=dict)
    batch_size: int = 512
    module_path: str = ""
    max_search_trials: int | None = None


def read_config(path: str) -> PlannerInput:
    """Parse the planner's sections of a model config (TOML).

    Raises:
        ConfigError: the file does not parse, or a section has unknown keys or bad values.
    """
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config: {e}") from e
    embedding = doc.get("embedding")
    if not isinstance(embedding, dict) or not embedding.get("tables"):
        raise ConfigError(f"{path}: no [[embedding.tables]]; the planner needs at least one table")
    # `[embedding] weight_dtype` and `id_map`: every table's unless it sets its own (as the
    # DLRM script); the planner gives id-mapped tables only the types they may have.
    defaults = {"weight_dtype": embedding.get("weight_dtype", "fp32")}
    if embedding.get("id_map") is not None:
        defaults["id_map"] = embedding["id_map"]
    tables = [
        _table(path, i, {**defaults, **t} if isinstance(t, dict) else t)
        for i, t in enumerate(embedding["tables"])
    ]
    optimizer = None
    if "optimizer" in embedding:
        optimizer = optimizer_from_dict(embedding["optimizer"], f"{path}: [embedding.optimizer]")
    result = PlannerInput(tables=tables, optimizer=optimizer)
    planner = doc.get("planner", {})
    if not isinstance(planner, dict):
        raise ConfigError(f"{path}: [planner] must be a table")
    unknown = sorted(set(planner) - PLANNER_KEYS - topology_fields())
    if unknown:
        raise ConfigError(
            f"{path}: [planner] has unknown keys {unknown}; valid: "
            f"{sorted(PLANNER_KEYS | topology_fields())}"
        )
    result.topology = {k: v for k, v in planner.items() if k in topology_fields()}
    result.batch_size = _typed(path, planner, "batch_size", int, 512)
    result.module_path = _typed(path, planner, "module_path", str, "")
    result.max_search_trials = _typed(path, planner, "max_search_trials", int, None)
    for name, values in planner.get("constraints", {}).items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: [planner.constraints.{name}] must be a table")
        result.constraints[name] = constraints_from_dict(name, values)
    return result


def _typed(path: str, section: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = section.get(key, default)
    if value is not default and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ConfigError(f"{path}: [planner] {key} must be {kind.__name__}, got {value!r}")
    return value


def _table(path: str, index: int, values: Any) -> BaseEmbeddingConfig:
    where = f"{path}: [[embedding.tables]] entry {index}"
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a table")
    if "name" in values:
        where += f" ({values['name']!r})"
    unpooled = values.get("unpooled", False)
    if not isinstance(unpooled, bool):
        raise ConfigError(f"{where}: unpooled must be true or false, got {unpooled!r}")
    valid = UNPOOLED_KEYS if unpooled else TABLE_KEYS
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid: {sorted(valid)}")
    fields = {k: v for k, v in values.items() if k != "unpooled"}
    try:
        if isinstance(fields.get("id_map"), dict):  # `id_map = { policy = "lru" }`
            fields["id_map"] = IdMapConfig(**fields["id_map"])
        if unpooled:
            return EmbeddingConfig(**fields)
        return EmbeddingBagConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recopt-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="model config (TOML) with [[embedding.tables]]")
    p.add_argument("--world-size", type=int, help="number of ranks to plan for")
    p.add_argument("--ranks-per-host", type=int, help="ranks per host (default: all on one)")
    p.add_argument("--topology", help="topology file (TOML or JSON), e.g. from --calibrate")
    p.add_argument("--batch-size", type=int, help="per-rank batch size (default: [planner])")
    p.add_argument(
        "--module-path",
        help="the module the tables are under in the model (default: [planner] module_path; "
        "the DLRM script's: embedding_bags)",
    )
    p.add_argument("--output", help="write the plan JSON (or, with --calibrate, the topology)")
    p.add_argument("--max-tables", type=int, default=50, help="tables to list in the stats")
    p.add_argument("--calibrate", action="store_true", help="measure this machine instead")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run `recopt-plan`; returns the exit status (0 ok, 1 no plan / bad config, 2 usage)."""
    args = _parser().parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--max-tables", args.max_tables)):
        if value is not None and value < 1:
            print(f"recopt-plan: error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    try:
        if args.calibrate:
            return _calibrate(args)
        if args.config is None or args.world_size is None:
            print("recopt-plan: error: give a config and --world-size", file=sys.stderr)
            return 2
        return _plan(args)
    except ValueError as e:
        print(f"recopt-plan: error: {e}", file=sys.stderr)
        return 1


def _plan(args: argparse.Namespace) -> int:
    config = read_config(args.config)
    values = dict(config.topology)
    if args.topology:
        values.update(load_topology_values(args.topology))
    overrides: dict[str, Any] = {"world_size": args.world_size}
    if args.ranks_per_host is not None:
        overrides["ranks_per_host"] = args.ranks_per_host
    topology = topology_from_dict(values, args.topology or args.config, **overrides)
    planner = EmbeddingShardingPlanner(
        topology,
        constraints=config.constraints,
        batch_size=args.batch_size or config.batch_size,
        default_optimizer=config.optimizer,
        max_search_trials=config.max_search_trials,
    )
    try:
        module_path = config.module_path if args.module_path is None else args.module_path
        plan = planner.plan({module_path: config.tables})
    except PlannerError as e:
        raise PlannerError(f"{e}\n{_memory_hint(args, config, topology)}") from e
    assert planner.stats is not None
    print(planner.stats.format(args.max_tables))
    explanation = planner.stats.explain_placements()
    if explanation:  # the plan needed UVM: say which tables, why, and the cost
        print(explanation)
    if args.output:
        plan.save(args.output)
        print(f"plan written to {args.output}")
    return 0


def _memory_hint(args: argparse.Namespace, config: PlannerInput, topology: Topology) -> str:
    """Where the memory per rank of this plan came from, and the setting that changes it."""
    key = "hbm_bytes" if topology.device == "cuda" else "ddr_bytes"
    if args.topology:
        source = f"{key} of --topology {args.topology}"
    elif key in config.topology:
        source = f"[planner] {key} of {args.config}"
    else:
        source = f"the default {key}: no [planner] {key} in {args.config}"
    return (
        f"recopt-plan planned {topology.world_size} {topology.device} ranks of "
        f"{format_bytes(getattr(topology, key))} each ({source}). To plan for ranks with more "
        f"memory, set it in the config's [planner] section ({key} = <bytes per rank>"
        + (", and ddr_bytes for host memory (UVM)" if key == "hbm_bytes" else "")
        + ") or pass --topology FILE (recopt-plan --calibrate --output FILE measures this "
        "machine); or plan for more ranks (--world-size)"
    )


def _calibrate(args: argparse.Namespace) -> int:
    from recopt.sharding.planner.calibrate import calibrate, topology_file_text

    topology = calibrate(args.ranks_per_host)
    text = topology_file_text(topology)
    print(text, end="")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"topology written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
