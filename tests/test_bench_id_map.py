"""benchmarks/bench_id_map.py's pipelined measurement on small maps: the two pipelines run in
blocks, every measured step of both is timed and paired, and the maps evict while timed."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_id_map  # noqa: E402


@pytest.mark.parametrize("block", [1, 3])
def test_pipelined_blocks_time_whole_blocks_of_both_steps(block: int) -> None:
    result = bench_id_map.measure_pipelined("worst", 2000, 2, 5, 1, "cpu", block)
    rounded = -(-5 // block) * block  # the steps, rounded up to whole blocks
    assert {k: len(v) for k, v in result.times.items()} == {
        "modulo step": rounded,
        "id_map step": rounded,
    }
    assert all(t > 0 for times in result.times.values() for t in times)
    assert result.evictions > 0 and result.occupancy == 1.0  # full maps, evicting
    assert result.worker_s is not None and result.worker_s > 0  # the remap worker's time


def test_the_report_prints_a_row_per_stream(capsys: pytest.CaptureFixture[str]) -> None:
    bench_id_map.main(
        ["--pipeline", "--stream", "drifting", "--rows", "2000", "--steps", "2", "--warmup", "1",
         "--block", "2"]
    )  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    (row,) = [line for line in lines if line.startswith("| drifting, pipelined |")]
    assert row.count("%") == 2 and float(row.split("|")[-2]) > 0  # the remap worker's ms
    assert lines[-1].startswith("(remap worker:")
