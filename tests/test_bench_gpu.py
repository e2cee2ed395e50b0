"""benchmarks/bench_gpu.py imports and parses its arguments anywhere; without CUDA it says so."""

from __future__ import annotations

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
