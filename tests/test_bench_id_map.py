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


def test_the_worker_host_time_bench_times_the_inline_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """benchmarks/bench_id_map_worker.py: a row per stream, the worker's step split into its
    native calls and the rest, and the pipeline's own methods back afterwards."""
    import bench_id_map_worker

    from recopt.kernels import cpu_id_map
    from recopt.modules import id_map_ahead, id_map_stage

    if not cpu_id_map.available():
        pytest.skip("no C compiler: no native id map")
    before = (id_map_ahead.AheadSteps.submit, id_map_stage.RemapStage.take, cpu_id_map.library)
    bench_id_map_worker.main(
        ["--stream", "drifting", "worst", "--rows", "2000", "--steps", "6", "--warmup", "4"]
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[2:]] == ["drifting", "worst"]
    for row in rows[2:]:
        step, native, rest, pipelined = (float(x) for x in row.split("|")[2:6])
        assert 0 < native < step and 0 < rest < step
        assert pipelined > step  # the worker's step is timed inside the pipelined step
    after = (id_map_ahead.AheadSteps.submit, id_map_stage.RemapStage.take, cpu_id_map.library)
    assert after == before
