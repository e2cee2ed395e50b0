"""benchmarks/torchrec_parity.py on a small stand-in checkout (no TorchRec needed): the
import swap, the shim's names and stubs, the classification and the counts table."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torchrec_parity  # noqa: E402

STAND_IN_TEST = """
import unittest

import torch
import torchrec
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, not_in_recopt


class KJTTest(unittest.TestCase):
    def test_public(self) -> None:
        kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]))
        self.assertEqual(kjt.length_per_key(), [2])
        self.assertIs(torchrec.KeyedJaggedTensor, KeyedJaggedTensor)

    def test_missing(self) -> None:
        not_in_recopt()

    def test_scriptable(self) -> None:
        torch.jit.script(KeyedJaggedTensor)
"""


def test_swap_imports_points_at_the_shim() -> None:
    text = "import torchrec\nfrom torchrec.optim.keyed import X\n@patch('torchrec.a.b')\n"
    assert torchrec_parity.swap_imports(text) == (
        "import torchrec_on_recopt as torchrec\n"
        "from torchrec_on_recopt.optim.keyed import X\n"
        "@patch('torchrec_on_recopt.a.b')\n"
    )


def test_categories() -> None:
    assert torchrec_parity.category("test_keyed_tensor.py::TestKeyedTensor::test_pytree") == (
        "public"  # the sparse types are registered with pytree, as TorchRec's
    )
    assert torchrec_parity.category("test_x.py::TestJaggedTensorTracing::test_a") == (
        "torchscript/fx"
    )
    assert torchrec_parity.category("test_x.py::TestKeyedTensorRegroupOp::test_a") == "internal"
    assert torchrec_parity.category("test_x.py::EmbeddingCollectionTest::test_forward") == (
        "public"
    )
    assert torchrec_parity.category("test_keyed.py::TestKeyedOptimizer::test_load") == "public"
    assert torchrec_parity.category("test_x.py::TestComputeKJTToJTDict::test_a") == "public"


def test_shim_serves_recopt_torchrec_first() -> None:
    assert torchrec_parity.recopt_module("optim.keyed") == "recopt.torchrec.optim.keyed"
    assert torchrec_parity.recopt_module("no_such_module") is None
    assert "recopt.torchrec.sparse.jagged_tensor" in torchrec_parity.shim_text(
        "sparse.jagged_tensor"
    )


def test_a_stand_in_checkout_runs_and_is_counted(tmp_path: pathlib.Path) -> None:
    checkout = tmp_path / "checkout"
    test_file = checkout / "torchrec/sparse/tests/test_stand_in.py"
    test_file.parent.mkdir(parents=True)
    test_file.write_text(STAND_IN_TEST)
    dest = tmp_path / "run"
    torchrec_parity.write_shim(dest)
    torchrec_parity.export(checkout, ["torchrec/sparse/tests/test_stand_in.py"], dest)
    report = torchrec_parity.run_pytest(dest, [])
    results = torchrec_parity.outcomes(report)
    assert {k: v[0] for k, v in results.items()} == {
        "test_stand_in.py::KJTTest::test_public": "passed",
        "test_stand_in.py::KJTTest::test_missing": "failed",
        "test_stand_in.py::KJTTest::test_scriptable": "failed",
    }
    assert "has no recopt equivalent" in results["test_stand_in.py::KJTTest::test_missing"][1]
    table = torchrec_parity.table(results)
    assert "| public | 2 | 1 |" in table and "| torchscript/fx | 1 | 0 |" in table


def test_export_names_a_folder_that_is_no_checkout(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"not a TorchRec work tree.*torchrec/none.py"):
        torchrec_parity.export(tmp_path, ["torchrec/none.py"], tmp_path / "run")
