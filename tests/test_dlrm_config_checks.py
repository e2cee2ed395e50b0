"""The DLRM script's config checks found by user trials (issue 29): every float field finite
and in range, a thread count torch can start, and the data's two seeds."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

from recopt.data import SyntheticClickLog, SyntheticConfig
from recopt.kernels import FusedOptimizerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_config  # noqa: E402


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("embedding.optimizer.lr=inf", r"'row_wise_adagrad': lr should be finite but is inf"),
        ("embedding.optimizer.eps=inf", r"eps \(eps1\) should be finite but is inf"),
        ("embedding.optimizer.weight_decay=inf", "weight_decay should be finite but is inf"),
        ("data.synthetic.signal=nan", r"data\.synthetic\.signal must be finite and >= 0.*nan"),
        ("data.synthetic.signal=-1", r"data\.synthetic\.signal must be finite and >= 0.*-1"),
        ("data.synthetic.zipf_exponent=inf", r"synthetic\.zipf_exponent must be finite.*inf"),
        ("data.synthetic.zipf_exponent=0", r"synthetic\.zipf_exponent must be finite and > 0"),
        ("data.synthetic.ctr_bias=-inf", r"data\.synthetic\.ctr_bias must be finite.*-inf"),
        ("clipping.max_gradient=nan", r"clipping\.max_gradient must be finite and >= 0.*nan"),
        ("clipping.max_gradient=-1", r"clipping\.max_gradient must be finite and >= 0.*-1"),
        ("clipping.norm_type=nan", r"clipping\.norm_type must be > 0 \(or inf"),
        ("clipping.norm_type=0", r"clipping\.norm_type must be > 0 \(or inf"),
        ("training.num_threads=100000", r"training\.num_threads 100000 is more than 4 per core"),
        # found by a user trial (2026-11-29): each failed late, deep inside, or not at all
        ("training.steps.x=3", r"override 'training\.steps\.x=3': training\.steps is a value"),
        ("embedding.tables=[]", r"embedding\.tables is empty"),
        ("model.dense_in_features=5", r"model\.dense_in_features \(5\) must equal .*num_dense"),
        ('embedding.tables.0.feature_names=["cat_1"]', r"read by several tables \{'cat_1'"),
        ("warmup.stages.0.value=-1", r"WarmupStage\.value must be finite and >= 0, got -1"),
    ],
)
def test_a_value_out_of_range_names_the_key_and_the_value(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dlrm_config.load_config(None, [override])


def test_the_limits_themselves_are_accepted() -> None:
    most = dlrm_config.MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
    config = dlrm_config.load_config(
        None,
        [
            f"training.num_threads={most}",
            "clipping.norm_type=inf",  # the max norm
            "clipping.max_gradient=0",
            "data.synthetic.signal=0",
            "embedding.optimizer.lr=0",
        ],
    )
    assert config.training.num_threads == most
    assert config.clipping.norm_type == float("inf")
    with pytest.raises(ValueError, match=f"use at most {most}"):
        dlrm_config.load_config(None, [f"training.num_threads={most + 1}"])


def test_the_component_configs_check_finiteness_themselves() -> None:
    with pytest.raises(ValueError, match="lr should be finite"):
        FusedOptimizerConfig(name="adam", lr=float("inf"))
    with pytest.raises(ValueError, match="signal must be finite"):
        SyntheticConfig(signal=float("inf"))


def test_main_refuses_too_many_threads_before_any_work(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config error is one line naming the key, exit status 2, nothing written."""
    import train as dlrm_train

    out = tmp_path / "run"
    argv = ["--set", "training.num_threads=100000", "--set", f"training.output_dir={out}"]
    assert dlrm_train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and "training.num_threads" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not out.exists()


def test_criteo_paths_are_checked_before_training(tmp_path: pathlib.Path) -> None:
    """Every Criteo path is checked at the start (a missing validation file used to surface
    at the first validation, a missing second training file after the first was read)."""
    data = tmp_path / "day_0.tsv"
    data.write_text("0\t" + "\t".join(["1"] * 13 + ["a"] * 26) + "\n")
    base = ['data.source="criteo"', f'data.criteo.train_paths=["{data}"]']
    assert dlrm_config.load_config(None, base).data.criteo.train_paths == (str(data),)
    for key, path in (("val_paths", tmp_path / "nope.tsv"), ("train_paths", tmp_path)):
        paths = [str(data), str(path)] if key == "train_paths" else [str(path)]
        override = f"data.criteo.{key}=[{', '.join(repr(p) for p in paths)}]"
        with pytest.raises(ValueError, match=rf"data\.criteo\.{key}: .* is not a readable file"):
            dlrm_config.load_config(None, [*base, override])


def _planted_logits(config: SyntheticConfig) -> torch.Tensor:
    """The hidden model's logit of one fixed set of inputs (latents and ids)."""
    log = SyntheticClickLog([("a", 1000), ("b", 50), ("c", 7)], config, 64)
    gen = torch.Generator().manual_seed(123)
    latent = torch.randn(64, config.num_dense, generator=gen)
    values = torch.cat([torch.randint(0, n, (64,), generator=gen) for n in (1000, 50, 7)])
    lengths = torch.ones(3 * 64, dtype=torch.int64)
    effects = log._bag_effects(values, lengths, [64, 64, 64]).view(3, 64)
    return log._hidden_logit(latent, effects)


def test_stream_seeds_share_the_hidden_model_that_model_seed_draws() -> None:
    # Fault-tolerant replica groups read different streams (data.synthetic.seed) of one task.
    first, second = SyntheticConfig(seed=0), SyntheticConfig(seed=1)
    torch.testing.assert_close(_planted_logits(first), _planted_logits(second), rtol=0, atol=0)
    batch_0 = SyntheticClickLog([("a", 1000)], first, 64).generate(0)
    batch_1 = SyntheticClickLog([("a", 1000)], second, 64).generate(0)
    assert not torch.equal(batch_0[0], batch_1[0])  # other samples
    other_task = SyntheticConfig(seed=0, model_seed=1)
    assert not torch.allclose(_planted_logits(first), _planted_logits(other_task))


def test_model_seed_is_a_config_key() -> None:
    config = dlrm_config.load_config(None, ["data.synthetic.model_seed=3"])
    assert config.data.synthetic.model_seed == 3 and config.data.synthetic.seed == 0
