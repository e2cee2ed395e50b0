"""benchmarks/bench_uvm.py (bench_gpu.py --uvm): on CPU, the planner's choice for the run's two
table sets; on a GPU host, a quick run end to end."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402
import bench_uvm  # noqa: E402

GIB = 2**30


def test_table_sets_are_sized_against_the_budget() -> None:
    cfg = bench_uvm.UvmConfig()
    rows = bench_uvm.rows_for(80 * GIB, 1.5, cfg)
    total = cfg.num_tables * rows * 4 * (cfg.dim + 1)
    assert 1.49 * 80 * GIB < total <= 1.5 * 80 * GIB


def test_the_planner_caches_the_large_set_and_keeps_the_small_one_in_hbm() -> None:
    cfg = bench_uvm.UvmConfig()
    budget = 8 * GIB  # described, not allocated: planning runs on CPU
    large, why = bench_uvm.plan_placements(bench_uvm.rows_for(budget, 1.5, cfg), budget, cfg)
    # As many tables as fit stay in HBM, the others are cached; none is left uncached.
    kinds = [p.describe() for p in large.values()]
    assert set(kinds) == {"device", "uvm_caching(0.2)"}
    assert f"{kinds.count('uvm_caching(0.2)')} of 8 tables live in host memory (UVM)" in why
    small, why = bench_uvm.plan_placements(bench_uvm.rows_for(budget, 0.5, cfg), budget, cfg)
    assert {p.describe() for p in small.values()} == {"device"} and why == ""


def test_uvm_flags_parse() -> None:
    args = bench_gpu.parse_args(["--out", "x.json", "--uvm-only", "--uvm-hbm-gib", "4"])
    assert args.uvm_only and args.uvm_hbm_gib == 4.0


def test_the_hbm_cap_is_lifted_after_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cap is process-wide: left on, it would starve the kernels bench_gpu.py times next
    # (and the cuda tests after test_cuda_quick_uvm_run in the same pytest process).
    fractions: list[float] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fractions.append)

    def fail(*args: object) -> dict:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(bench_uvm, "_run_sets", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        bench_uvm.run_uvm(lambda step, w, s: 0.0, 1, 1, 8.0, bench_uvm.UvmConfig())
    assert fractions == [8 / 80, 1.0]  # of the device's total memory, as torch defines it
    fractions.clear()
    monkeypatch.setattr(bench_uvm, "_run_sets", lambda *args: {"ok": True})
    assert bench_uvm.run_uvm(lambda step, w, s: 0.0, 1, 1, None, bench_uvm.UvmConfig()) == {
        "ok": True
    }
    assert fractions == []  # no budget given: no cap set, none to lift


@pytest.mark.cuda
def test_cuda_quick_uvm_run(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "uvm.json"
    args = ["--out", str(out), "--quick", "--uvm-only", "--warmup", "1", "--steps", "2"]
    assert bench_gpu.main(args) == 0
    assert "UVM target" in out.with_suffix(".md").read_text()
    assert torch.cuda.is_available()
