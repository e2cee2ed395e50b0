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
