"""benchmarks/bench_gpu.py imports and parses its arguments anywhere; without CUDA it says so."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402


def test_help_and_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        bench_gpu.main(["--help"])
    assert done.value.code == 0 and "--out" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_gpu.main(["--out", "x.json", "--configs", "A,Z"])
    assert "unknown ['Z']" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_it_fails_with_a_clear_message(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_gpu.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_report_table_has_every_candidate_syncs_and_the_target_ratio() -> None:
    def row(opt: str, cand: str, ms: float, syncs: float) -> dict:
        return {"config": "A", "optimizer": opt, "candidate": cand, "ms": ms, "syncs": syncs}

    kernels = [
        row("row_wise_adagrad", "fbgemm_direct", 2.0, 0.0),
        row("row_wise_adagrad", "fused_auto", 2.5, 1.0),
        row("row_wise_adagrad", "recopt_kernel", 8.0, 27.0),
        row("adafactor", "fused_auto", 6.0, 27.0),
        row("adafactor", "recopt_kernel", 6.0, 27.0),
        row("adafactor", "recopt_torch_ops", 12.0, 27.0),
        {"config": "A", "optimizer": "adam", "candidate": "fbgemm_direct", "error": "boom"},
    ]
    table = bench_gpu.markdown(kernels, [], "a test GPU")
    lines = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| A")}
    assert lines["row_wise_adagrad"] == (
        "| A | row_wise_adagrad | 2.0 (0.0) | 2.5 (1.0) | 8.0 (27.0) | - | 0.80x | 4.00x |"
    )
    assert (
        lines["adafactor"]
        == "| A | adafactor | - | 6.0 (27.0) | 6.0 (27.0) | 12.0 (27.0) | - | 3.00x |"
    )
    assert lines["adam"].startswith("| A | adam | error | - | - | - |")


def test_dlrm_config_has_the_dlrm_scripts_power_law_ids() -> None:
    cfg = bench_gpu.CONFIGS["DLRM"]
    ids = bench_gpu.make_batches(cfg, 1, torch.device("cpu"))[0]
    assert ids.shape == (cfg.num_tables * cfg.batch,)
    per_feature = ids.view(cfg.num_tables, cfg.batch)
    assert int(ids.min()) >= 0 and int(ids.max()) < cfg.rows
    hottest = [int(torch.bincount(row).max()) for row in per_feature]
    # The issue's ~1,600 copies of one id a feature at batch 16384; uniform ids (config A
    # shape) never repeat an id more than a handful of times.
    assert min(hottest) > 1000 and max(hottest) < 2500
    uniform = bench_gpu.make_batches(bench_gpu.CONFIGS["A"], 1, torch.device("cpu"))[0]
    assert int(torch.bincount(uniform[: cfg.batch]).max()) < 10


def test_release_frees_a_candidate_held_by_a_reference_cycle() -> None:
    import weakref

    class Module:
        pass

    module = Module()
    module.me = module  # type: ignore[attr-defined]  # a cycle, as a bound method held by its owner
    alive = weakref.ref(module)
    del module
    bench_gpu.release()
    assert alive() is None


def test_every_kernel_row_is_saved_as_it_is_measured_and_memory_released(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "k.json"
    results = bench_gpu.Results(out, {"device": "cpu"})
    results.save()  # as main() does before the first row
    seen: list[int] = []  # rows already in the file when each candidate is timed
    released: list[int] = []

    def timed(step: object, warmup: int, steps: int) -> float:
        seen.append(len(json.loads(out.read_text())["kernels"]))
        if len(seen) == 3:
            raise RuntimeError("out of memory")  # a failing candidate keeps the others' rows
        return 1.5

    monkeypatch.setattr(bench_gpu, "fbgemm_direct", lambda *a, **k: lambda i: None)
    monkeypatch.setattr(bench_gpu, "fused_collection", lambda *a, **k: lambda i: None)
    monkeypatch.setattr(bench_gpu, "time_ms", timed)
    monkeypatch.setattr(bench_gpu, "host_syncs", lambda step, n: {"syncs": 2.0})
    monkeypatch.setattr(bench_gpu, "release", lambda: released.append(len(seen)))
    bench_gpu.run_kernels(bench_gpu.QUICK["A"], 1, 1, results, torch.device("cpu"))
    count = 4 * 4 + 3  # four candidates each for sgd .. row-wise Adam, three for Adafactor
    assert seen == list(range(count)) and released == list(range(1, count + 1))
    saved = json.loads(out.read_text())["kernels"]
    assert len(saved) == count and "out of memory" in saved[2]["error"]
    assert saved[0] == {
        "config": "A", "optimizer": "sgd", "candidate": "fbgemm_direct", "ms": 1.5, "syncs": 2.0
    }  # fmt: skip
    assert "| A | sgd | 1.5 (2.0) |" in out.with_suffix(".md").read_text()
