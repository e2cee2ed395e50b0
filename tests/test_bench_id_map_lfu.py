"""benchmarks/bench_id_map_lfu.py on small maps: both ways of choosing lfu's victims run and
time a step, and the table names the way the default takes at each size."""

from __future__ import annotations

import pathlib
import sys

import pytest

from recopt.kernels import cpu_id_map

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_id_map_lfu  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_id_map.available(), reason="no C compiler")


def test_both_ways_time_their_steps_and_the_default_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    default = cpu_id_map.lfu_buckets_min_rows()
    ms = bench_id_map_lfu.measure(3000, 3)
    assert set(ms) == {"buckets", "every row"} and all(v > 0 for v in ms.values())
    assert cpu_id_map.lfu_buckets_min_rows() == default  # the setting is put back
    bench_id_map_lfu.main(["--rows", "3000", str(default), "--steps", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].endswith("| every row |") and lines[3].endswith("| buckets |")
