"""``recopt-reshard``: rewrite a checkpoint for another world size or plan, or export it whole.

recopt-reshard SRC DST --world-size M [--plan plan.json [--config model.toml]]
recopt-reshard SRC DST --to-full

With a plan and the model config (the one ``recopt-plan`` reads, for each table's ``id_map``),
each live id of an id-mapped table is written on the row shard that owns it; without the
config its rows stay at their global rows (a warning says so) and the first forward after the
load moves the ids.
"""

from __future__ import annotations

import argparse
import sys

from recopt.checkpoint.reshard import export_full, reshard
from recopt.checkpoint.reshard_report import Progress, ReshardReport
from recopt.checkpoint.state import CheckpointError
from recopt.progress import ProgressLine
from recopt.sharding.plan import PlanError, ShardingPlan
from recopt.sharding.planner.cli import read_config

_BAR = 30


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recopt-reshard",
        description="Rewrite a recopt checkpoint for another world size or sharding plan "
        "(streaming, table by table), or export plain unsharded tensors as safetensors.",
    )
    parser.add_argument("src", help="a complete recopt checkpoint directory")
    parser.add_argument("dst", help="the output directory (must not exist)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--world-size", type=int, help="the world size the output is for")
    target.add_argument(
        "--to-full",
        action="store_true",
        help="write model.safetensors and state.safetensors with unsharded tensors",
    )
    parser.add_argument("--plan", help="the target plan (JSON from ShardingPlan.to_json)")
    parser.add_argument(
        "--config",
        help="the model config (TOML with [[embedding.tables]], as recopt-plan reads): with "
        "--plan, id-mapped tables' ids are written on their owner shards",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


class _Bar:
    """The tensor-by-tensor bar; off a terminal about ten plain lines in all."""

    def __init__(self) -> None:
        self.line: ProgressLine | None = None

    def __call__(self, p: Progress) -> None:
        if self.line is None:
            self.line = ProgressLine(sys.stderr, plain_every=max(1, -(-p.total_tensors // 10)))
        filled = _BAR * p.done_bytes // max(p.total_bytes, 1)
        self.line.show(
            f"[{'#' * filled}{'.' * (_BAR - filled)}] {p.done_tensors}/{p.total_tensors} "
            f"tensors {_mib(p.done_bytes)} / {_mib(p.total_bytes)} {p.seconds:.1f}s",
            final=p.done_tensors == p.total_tensors,
        )

    def close(self) -> None:
        if self.line is not None:
            self.line.close()


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the process exit status (0 ok, 2 bad arguments or checkpoint)."""
    args = _parser().parse_args(argv)
    progress = None if args.quiet else _Bar()
    try:
        if args.to_full:
            if args.plan or args.config:
                raise PlanError(
                    "--plan and --config have no meaning with --to-full (the output is unsharded)"
                )
            report = export_full(args.src, args.dst, progress=progress)
        else:
            plan = ShardingPlan.load(args.plan) if args.plan else None
            if args.config and plan is None:
                raise PlanError("--config is read with --plan only (it places id-mapped ids)")
            tables = read_config(args.config).tables if args.config else None
            report = reshard(
                args.src,
                args.dst,
                world_size=args.world_size,
                plan=plan,
                tables=tables,
                progress=progress,
            )
    except (CheckpointError, PlanError, ValueError, OSError) as e:
        if progress is not None:
            progress.close()
        print(f"recopt-reshard: error: {e}", file=sys.stderr)
        return 2
    if progress is not None:
        progress.close()
    print(_summary(args.src, args.dst, report))
    return 0


def _summary(src: str, dst: str, report: ReshardReport) -> str:
    target = (
        "unsharded safetensors"
        if report.target_world_size is None
        else f"{report.target_world_size} ranks"
    )
    rate = report.bytes / max(report.seconds, 1e-9) / (1 << 20)
    text = (
        f"{src} ({report.source_world_size} ranks) -> {dst} ({target}): {report.tensors} "
        f"tensors ({report.tables} embedding tables), {_mib(report.bytes)} in "
        f"{report.seconds:.2f}s ({rate:,.0f} MiB/s)"
    )
    if report.id_map_tables:
        text += (
            f"\nid maps: {report.id_map_tables} tables placed for the plan, "
            f"{report.id_rows_moved} ids moved to their owner shard "
            f"({report.id_rows_dropped} dropped: no room), {report.id_candidates_moved} "
            f"candidates moved ({report.id_candidates_dropped} dropped)"
        )
    return text


if __name__ == "__main__":
    sys.exit(main())
