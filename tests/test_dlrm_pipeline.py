"""The DLRM script pipelines by default: its results equal the plain loop's bit for bit, on one
rank and on two sharded ranks, and its metrics log carries the pipeline's phase times."""

from __future__ import annotations

import pathlib

import pytest
from test_dlrm import dlrm_train, records, small_run, torchrun

PHASES = {f"pipeline_{p}_ms" for p in ("copy", "input_dist", "forward", "backward", "optimizer")}


def _comparable(out: pathlib.Path) -> list[dict[str, float]]:
    """Every record without its timings (wall time, throughput, phase times)."""
    return [
        {k: v for k, v in r.items() if k not in PHASES | {"time_s", "samples_per_s"}}
        for r in records(out)
    ]


def _check(pipelined: pathlib.Path, plain: pathlib.Path) -> None:
    assert _comparable(pipelined) == _comparable(plain)  # losses, AUCs, NE: bit-identical
    train = [r for r in records(pipelined) if r["split"] == "train"]
    assert train and all(PHASES <= set(r) for r in train)
    assert all(r["pipeline_forward_ms"] > 0 for r in train)
    assert not any(PHASES & set(r) for r in records(plain))


def test_one_rank_pipelined_run_equals_the_plain_loop(tmp_path: pathlib.Path) -> None:
    args = ("--set", "training.eval_every=50", "--set", "checkpoint.every=0")
    assert dlrm_train.main(small_run(tmp_path / "on", 50, *args)) == 0
    off = ("--set", "training.pipeline=false")
    assert dlrm_train.main(small_run(tmp_path / "off", 50, *args, *off)) == 0
    _check(tmp_path / "on", tmp_path / "off")


@pytest.mark.multiprocess
def test_two_ranks_pipelined_run_equals_the_plain_loop(tmp_path: pathlib.Path) -> None:
    args = ("--set", "training.eval_every=40", "--set", "checkpoint.every=0")
    on = torchrun(*small_run(tmp_path / "on", 40, *args))
    assert on.returncode == 0, on.stderr[-3000:]
    off = torchrun(*small_run(tmp_path / "off", 40, *args, "--set", "training.pipeline=false"))
    assert off.returncode == 0, off.stderr[-3000:]
    _check(tmp_path / "on", tmp_path / "off")
