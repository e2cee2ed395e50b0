"""DLRM / DCNv2 against hand computations, config loading, and the training script end to end."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

from recopt.models import DLRM, CrossNetwork, DLRMConfig, DotInteraction, FusedLinear
from recopt.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_config  # noqa: E402
import train as dlrm_train  # noqa: E402


def tables(dim: int = 4, rows: tuple[int, ...] = (10, 20, 30)) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=n, embedding_dim=dim, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(rows)
    ]


def kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists(
        {"f0": [[1, 2], [3]], "f1": [[4], []], "f2": [[5, 6, 7], [8]]}
    )


# ------------------------------------------------------------------------ interactions


def test_dot_interaction_is_the_strict_upper_triangle() -> None:
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]])
    out = DotInteraction(3)(x)
    # pairs (0,1), (0,2), (1,2): 1*3+2*4, 1*5+2*6, 3*5+4*6 ; then the second sample
    assert out.tolist() == [[11.0, 17.0, 39.0], [0.0, 2.0, 2.0]]
    assert DotInteraction(27).num_outputs == 351


def test_dot_interaction_gradient_matches_autograd_of_the_plain_formula() -> None:
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(DotInteraction(5).double(), (x,))
    rows, cols = torch.triu_indices(5, 5, offset=1)
    weights = torch.randn(3, 10, dtype=torch.float64)
    (DotInteraction(5)(x) * weights).sum().backward()
    ours, x.grad = x.grad, None
    (torch.bmm(x, x.transpose(1, 2))[:, rows, cols] * weights).sum().backward()
    torch.testing.assert_close(ours, x.grad)


def test_cross_network_full_and_low_rank_match_the_formula() -> None:
    torch.manual_seed(0)
    x0 = torch.randn(5, 6)
    full = CrossNetwork(6, num_layers=2)
    x1 = x0 * full.up[0](x0) + x0
    x2 = x0 * full.up[1](x1) + x1
    torch.testing.assert_close(full(x0), x2)
    low = CrossNetwork(6, num_layers=1, low_rank=2)
    u, v = low.up[0], low.down[0]
    assert isinstance(u, nn.Linear) and isinstance(v, nn.Linear)
    expected = x0 * (x0 @ v.weight.T @ u.weight.T + u.bias) + x0
    torch.testing.assert_close(low(x0), expected)
    assert sum(p.numel() for p in low.parameters()) == 6 * 2 + 2 * 6 + 6


@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linear_equals_torch_linear_forward_and_backward(activation: str, bias: bool) -> None:
    torch.manual_seed(0)
    layer = FusedLinear(37, 19, activation, bias=bias)
    reference = FusedLinear(37, 19, activation, bias=bias, use_onednn=False)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(64, 37, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad = torch.randn(64, 19)
    out, out_ref = layer(x), reference(x_ref)
    expected = torch.nn.functional.linear(x_ref, reference.weight, reference.bias)
    if activation == "relu":
        expected = expected.relu()
    torch.testing.assert_close(out_ref, expected)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    (out * grad).sum().backward()
    (out_ref * grad).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for p, q in zip(layer.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-4)


def test_fused_linear_skips_the_input_gradient_when_the_input_needs_none() -> None:
    layer = FusedLinear(5, 3, "relu")
    layer(torch.randn(4, 5)).sum().backward()
    assert layer.weight.grad is not None and layer.bias is not None and layer.bias.grad is not None
    with pytest.raises(ValueError, match="activation 'gelu'"):
        FusedLinear(5, 3, "gelu")


# ------------------------------------------------------------------------ DLRM


def test_dlrm_forward_equals_a_hand_computation() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables())
    model = DLRM(ebc, DLRMConfig(bottom_mlp=(8, 4), top_mlp=(5,)))
    dense = torch.randn(2, 13)
    features = kjt()
    ids = {"f0": [[1, 2], [3]], "f1": [[4], []], "f2": [[5, 6, 7], [8]]}
    bottom = model.bottom_mlp(dense)
    logits = []
    for b in range(2):
        vectors = [bottom[b]]
        for i in range(3):
            weight = ebc.embedding_bags[f"t{i}"].weight
            vectors.append(sum((weight[j] for j in ids[f"f{i}"][b]), torch.zeros(4)))
        dots = [vectors[i] @ vectors[j] for i in range(4) for j in range(i + 1, 4)]
        logits.append(model.top_mlp(torch.cat([bottom[b], torch.stack(dots)]))[0])
    torch.testing.assert_close(model(dense, features), torch.stack(logits))


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
@pytest.mark.parametrize("fused", [False, True])
def test_dlrm_shapes_and_gradients(interaction: str, fused: bool) -> None:
    config = DLRMConfig(bottom_mlp=(8, 4), top_mlp=(6, 3), interaction=interaction, dcn_low_rank=2)
    ebc: nn.Module = (
        FusedEmbeddingBagCollection(tables()) if fused else EmbeddingBagCollection(tables())
    )
    model = DLRM(ebc, config)
    logits = model(torch.randn(2, 13), kjt())
    assert logits.shape == (2,)
    logits.sum().backward()
    dense_grads = [p.grad for n, p in model.named_parameters() if "embedding_bags" not in n]
    assert dense_grads and all(g is not None and g.abs().sum() > 0 for g in dense_grads[:2])


def test_dlrm_rejects_an_embedding_dim_that_differs_from_the_bottom_mlp() -> None:
    with pytest.raises(ValueError, match=r"embedding_dim 4 .* model.bottom_mlp\[-1\] = 4"):
        DLRM(EmbeddingBagCollection(tables()), DLRMConfig(bottom_mlp=(8, 16)))
    DLRM(EmbeddingBagCollection(tables()), DLRMConfig(bottom_mlp=(8, 16), interaction="dcn"))
    with pytest.raises(ValueError, match="interaction 'cross'"):
        DLRMConfig(interaction="cross")


# ------------------------------------------------------------------------ config


def test_config_defaults_are_configs_dlrm_small() -> None:
    assert dlrm_config.load_config(None) == dlrm_config.load_config(
        str(ROOT / "configs/dlrm_small.toml")
    )
    big = dlrm_config.load_config(str(ROOT / "configs/dlrm_criteo_shape.toml"))
    assert len(big.embedding.tables) == 26 and big.data.batch_size == 2048
    assert {(t.num_embeddings, t.embedding_dim) for t in big.embedding.tables} == {(100_000, 64)}
    assert big.data.synthetic.max_ids_per_bag == 1


def test_config_overrides_reach_every_section() -> None:
    config = dlrm_config.load_config(
        None,
        [
            "training.steps=7",
            "model.bottom_mlp=[32, 8]",
            "embedding.tables.0.embedding_dim=8",
            "embedding.optimizer.name=adam",
            "dense_optimizer.lr=0.5",
            "clipping.clipping=value",
        ],
    )
    assert config.training.steps == 7 and config.model.bottom_mlp == (32, 8)
    assert config.embedding.tables[0].embedding_dim == 8
    assert config.embedding.optimizer.name == "adam" and config.dense_optimizer.lr == 0.5
    assert config.clipping.clipping.value == "value"


@pytest.mark.parametrize("name", ["lamb", "row_wise_lamb"])
def test_config_accepts_lamb_and_checks_its_betas(name: str) -> None:
    config = dlrm_config.load_config(
        None,
        [
            f"embedding.optimizer.name={name}",
            "embedding.optimizer.betas=[0.8, 0.99]",
            "embedding.optimizer.weight_decay=0.01",
        ],
    )
    optimizer = config.embedding.optimizer
    assert (optimizer.name, optimizer.betas, optimizer.weight_decay) == (name, (0.8, 0.99), 0.01)
    with pytest.raises(ValueError, match=r"betas\[1\] \(beta2\) should be in \[0, 1\)"):
        dlrm_config.load_config(
            None, [f"embedding.optimizer.name={name}", "embedding.optimizer.betas=[0.9, 1.0]"]
        )


def test_config_weight_dtype_for_every_table_with_a_per_table_override(
    tmp_path: pathlib.Path,
) -> None:
    from recopt.kernels.precision import Precision

    config = dlrm_config.load_config(
        str(ROOT / "configs/dlrm_small.toml"),
        [
            "embedding.weight_dtype=fp16",
            "embedding.tables.1.weight_dtype=bf16",
            "embedding.optimizer.state_dtype=bf16",
        ],
    )
    dtypes = [t.weight_dtype for t in config.embedding.tables]
    assert dtypes == [Precision.FP16, Precision.BF16] + [Precision.FP16] * 6
    assert config.embedding.optimizer.state_dtype is Precision.BF16
    # A table's own weight_dtype in the file wins over the section's.
    text = (ROOT / "configs/dlrm_small.toml").read_text()
    own = tmp_path / "own.toml"
    own.write_text(text.replace('name = "t2"\n', 'name = "t2"\nweight_dtype = "fp32"\n'))
    config = dlrm_config.load_config(str(own), ["embedding.weight_dtype=bf16"])
    assert [t.weight_dtype.value for t in config.embedding.tables][1:4] == ["bf16", "fp32", "bf16"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("embedding.weight_dtype=fp8", r"embedding\.weight_dtype: 'fp8' is not a supported"),
        ("embedding.optimizer.state_dtype=int8", r"state_dtype = 'int8' is not one of"),
        ("training.stepz=1", r"unknown config key training\.stepz; valid keys in \[training\]"),
        ("trainin.steps=1", "unknown config key trainin;"),
        ("embedding.tables.0.dim=8", r"unknown config key embedding\.tables\[0\]\.dim"),
        ("planner.gpus=8", r"unknown config key planner\.gpus"),
        ("training.steps=many", r"training\.steps = 'many' must be of type int"),
        ("model.interaction=cross", "interaction 'cross' is unknown"),
        ("embedding.tables.9.name=x", "must index the list"),
        ("steps", "must look like section.key=value"),
    ],
)
def test_config_errors_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dlrm_config.load_config(None, [override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("checkpoint.every=-1", r"checkpoint\.every must be >= 0 .*got -1"),
        ("checkpoint.keep=-1", r"checkpoint\.keep must be >= 1 .*got -1"),
        ("checkpoint.keep=0", r"checkpoint\.keep must be >= 1 .*got 0"),
        ("training.timeout_s=0", r"training\.timeout_s must be finite and > 0 .*got 0"),
        ("training.timeout_s=inf", r"training\.timeout_s must be finite and > 0 .*got inf"),
        ("training.steps=0", r"training\.steps must be >= 1, got 0"),
        ("training.num_threads=-1", r"training\.num_threads must be >= 0, got -1"),
        ("training.remap_threads=0", r"training\.remap_threads must be >= 1, got 0"),
        ("dense_optimizer.lr=inf", r"dense_optimizer\.lr must be finite and > 0, got inf"),
        ("dense_optimizer.lr=nan", r"dense_optimizer\.lr must be finite and > 0, got nan"),
        ("dense_optimizer.lr=-inf", r"dense_optimizer\.lr must be finite and > 0, got -inf"),
        ("dense_optimizer.eps=0", r"dense_optimizer\.eps must be finite and > 0"),
        ("dense_optimizer.betas=[0.9, 1.0]", r"dense_optimizer\.betas must each be in \[0, 1\)"),
        ("fault_tolerance.timeout_s=inf", r"fault_tolerance\.timeout_s must be finite and > 0"),
    ],
)
def test_config_values_out_of_range_name_key_and_range(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dlrm_config.load_config(None, [override])


def test_config_file_errors(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nbottom_mlp = [8, 4\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        dlrm_config.load_config(str(bad))
    with pytest.raises(ValueError, match="cannot be read"):
        dlrm_config.load_config(str(tmp_path / "missing.toml"))


# ------------------------------------------------------------------------ the script


def small_run(out: pathlib.Path, steps: int, *extra: str) -> list[str]:
    return [
        "--set", f"training.steps={steps}",
        "--set", "training.log_every=25",
        "--set", f"training.output_dir={out}",
        "--set", "training.plot=false",
        "--set", "data.batch_size=256",
        "--set", "data.val_batches=4",
        *extra,
    ]  # fmt: skip


def records(out: pathlib.Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_main_learns_the_synthetic_signal(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    argv = small_run(out, 300, "--set", "training.eval_every=150", "--set", "training.plot=true")
    assert dlrm_train.main(argv) == 0
    logged = records(out)
    train = [r for r in logged if r["split"] == "train"]
    val = [r for r in logged if r["split"] == "val"]
    assert [r["step"] for r in val] == [150, 300] and len(train) == 12
    assert {"loss", "auc", "accuracy", "ne", "samples_per_s"} <= set(train[0])
    assert val[-1]["auc"] > 0.75 and val[-1]["ne"] < 0.9
    assert train[-1]["auc"] > train[0]["auc"] + 0.03  # rising
    assert (out / "curves.png").stat().st_size > 1000
    # checkpoint.every=500 > steps: only the end of training is saved
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000000300"]


@pytest.mark.parametrize("precision", ["fp32", "fp16-bf16-state"])
def test_resume_from_checkpoint_equals_an_uninterrupted_run(
    tmp_path: pathlib.Path, precision: str
) -> None:
    every = ["--set", "checkpoint.every=40", "--set", "training.eval_every=0"]
    if precision != "fp32":  # stochastic rounding: its pass counters are checkpointed
        every += ["--set", "embedding.weight_dtype=fp16"]
        every += ["--set", "embedding.optimizer.state_dtype=bf16"]
    whole = dlrm_config.load_config(None, small_run(tmp_path / "a", 120, *every)[1::2])
    result = dlrm_train.train(whole, dlrm_train.RunEnv())
    first = dlrm_config.load_config(None, small_run(tmp_path / "b", 80, *every)[1::2])
    dlrm_train.train(first, dlrm_train.RunEnv())
    again = dlrm_config.load_config(None, small_run(tmp_path / "b", 120, *every)[1::2])
    resumed = dlrm_train.train(again, dlrm_train.RunEnv(), resume=True)
    assert resumed == result  # bit-identical validation metrics after step 120
    steps = [r["step"] for r in records(tmp_path / "b") if r["split"] == "train"]
    assert steps == [25, 50, 75, 80, 100, 120]  # the resumed run continued at step 81


def _criteo_args(tmp_path: pathlib.Path, lines: int, steps: int, *extra: str) -> list[str]:
    from test_data import criteo_line

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "day.tsv"
    data.write_text("".join(criteo_line(i) for i in range(lines)))
    tables = ", ".join(
        f"{{name='t{i}', num_embeddings=100, embedding_dim=16, feature_names=['cat_{i}']}}"
        for i in range(26)
    )
    args = small_run(tmp_path / "out", steps, "--set", "data.val_batches=0", *extra)
    for item in ["data.source=criteo", f"data.criteo.train_paths=['{data}']"]:
        args += ["--set", item]
    return [*args, "--set", f"embedding.tables=[{tables}]", "--set", "data.batch_size=8"]


def test_criteo_smaller_than_a_batch_or_empty_is_an_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"holds 5 samples, fewer than one batch of 8"):
        dlrm_train.main(_criteo_args(tmp_path, 5, 10))
    with pytest.raises(ValueError, match=r"day.tsv is empty"):
        dlrm_train.main(_criteo_args(tmp_path, 0, 10))


def test_training_epochs_pass_over_criteo_again(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_each = ("--set", "training.log_every=1")
    assert dlrm_train.main(_criteo_args(tmp_path / "one", 20, 100, *log_each)) == 0
    assert "exhausted after 2 steps (1 epoch(s)" in capsys.readouterr().err
    args = _criteo_args(tmp_path / "three", 20, 100, *log_each, "--set", "training.epochs=3")
    assert dlrm_train.main(args) == 0
    train = [r for r in records(tmp_path / "three" / "out") if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # 2 batches of 8 per pass over 20
    assert train[-1]["samples"] == 48


def test_progress_off_a_terminal_is_one_plain_line_per_log_every(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = small_run(tmp_path, 6, "--set", "training.log_every=3", "--set", "data.val_batches=0")
    assert dlrm_train.main(argv) == 0
    err = capsys.readouterr().err  # captured: not a terminal
    assert "\r" not in err
    assert [line.split(" [")[0] for line in err.splitlines() if line.startswith("step ")] == [
        "step 3/6",
        "step 6/6",
    ]


def test_main_reports_a_bad_config_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert dlrm_train.main(["--set", "data.sourse=criteo"]) == 2
    assert "unknown config key data.sourse" in capsys.readouterr().err


# ------------------------------------------------------------------------ two ranks (torchrun)


def torchrun(*args: str, timeout: float = 240, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("recopt.sharding.model_parallel")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
    ]
    return subprocess.run(
        [*command, str(ROOT / "examples/dlrm/train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        # Two ranks on CPU/gloo, also on a host with one GPU (two ranks cannot share it there).
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.mark.multiprocess
def test_two_ranks_resume_equals_an_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    every = ("--set", "training.eval_every=40", "--set", "checkpoint.every=20")
    whole = torchrun(*small_run(tmp_path / "whole", 40, *every))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "whole/checkpoints").iterdir()) == [
        "step_000000020",
        "step_000000040",
    ]
    first = torchrun(*small_run(tmp_path / "parts", 20, *every))
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun(*small_run(tmp_path / "parts", 40, *every), "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 20" in second.stderr

    def last_val(out: pathlib.Path) -> dict[str, float]:
        val = [r for r in records(out) if r["split"] == "val"]
        assert val[-1]["step"] == 40
        return {k: v for k, v in val[-1].items() if k != "time_s"}

    assert last_val(tmp_path / "parts") == last_val(tmp_path / "whole")  # bit-identical
    assert last_val(tmp_path / "whole")["auc"] > 0.6


def _run(out: pathlib.Path, steps: int, ranks: int, *extra: str) -> None:
    args = small_run(out, steps, "--set", "training.eval_every=0", *extra)
    if ranks == 1:
        assert dlrm_train.main(args) == 0
        return
    result = torchrun(*args, nproc=ranks)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("before", "after", "first_steps"), [(1, 2, 20), (2, 3, 30)])
def test_resume_at_another_world_size_continues_the_stream(
    tmp_path: pathlib.Path, before: int, after: int, first_steps: int
) -> None:
    # N ranks for first_steps steps, then M ranks for 10 more, against M ranks throughout
    # over the same samples: the resumed run sees exactly those samples (none repeated or
    # skipped, the data position is a global one) and ends at a loss close to the reference's.
    save = ("--set", f"checkpoint.every={first_steps}", "--set", "training.log_every=10")
    _run(tmp_path / "parts", first_steps, before, *save)
    _run(tmp_path / "parts", first_steps + 10, after, *save, "--resume")
    reference_steps = first_steps * before // after + 10
    _run(tmp_path / "whole", reference_steps, after, "--set", "training.log_every=10")

    def last(out: pathlib.Path, split: str) -> dict[str, float]:
        return [r for r in records(out) if r["split"] == split][-1]

    parts, whole = last(tmp_path / "parts", "train"), last(tmp_path / "whole", "train")
    assert parts["samples"] == whole["samples"] == 256 * after * reference_steps
    parts_val, whole_val = last(tmp_path / "parts", "val"), last(tmp_path / "whole", "val")
    assert parts_val["loss"] == pytest.approx(whole_val["loss"], rel=0.05)


@pytest.mark.multiprocess
def test_a_failing_rank_stops_every_rank_with_its_message(tmp_path: pathlib.Path) -> None:
    # Line 2 is malformed, and only rank 1 reads it (rank r reads lines r, r+2, ...): rank 0
    # is left waiting in a collective and must not hang.
    from test_data import criteo_line

    data = tmp_path / "day.tsv"
    lines = [criteo_line(i) for i in range(64)]
    fields = lines[1].split("\t")
    lines[1] = "\t".join([fields[0], "not-a-number", *fields[2:]])
    data.write_text("".join(lines))
    overrides = [
        "data.source=criteo",
        f"data.criteo.train_paths=['{data}']",
        "embedding.tables=["
        + ", ".join(
            f"{{name='t{i}', num_embeddings=100, embedding_dim=16, feature_names=['cat_{i}']}}"
            for i in range(26)
        )
        + "]",
    ]
    args = small_run(tmp_path, 10)
    for item in overrides:
        args += ["--set", item]
    result = torchrun(*args, "--set", "data.batch_size=8", "--set", "training.timeout_s=60")
    assert result.returncode != 0
    assert "[rank 1/2] training failed: ValueError" in result.stderr
    assert "day.tsv:2: column 1 (integer feature 1)" in result.stderr


def test_reporting_without_matplotlib_and_on_a_pipe(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    import dlrm_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    notice = dlrm_report.plot_curves(
        [{"step": 1, "split": "train", "loss": 0.5}], str(tmp_path / "c.png")
    )
    assert notice is not None and "matplotlib is not installed" in notice
    assert not (tmp_path / "c.png").exists()
    stream = io.StringIO()  # not a terminal: one line per update, no carriage returns
    bar = dlrm_report.ProgressBar(10, stream=stream)
    bar.update(5, 12_345.0, {"loss": 0.5, "auc": float("nan")})
    bar.message("validation ...")
    assert stream.getvalue().splitlines() == [
        "step 5/10 [============>           ]  50% | 12.3k samples/s | loss 0.5000",
        "validation ...",
    ]


def test_another_embedding_optimizer_gets_its_reference_defaults() -> None:
    load_config = dlrm_config.load_config
    adam = load_config(None, ["embedding.optimizer.name=adam"]).embedding.optimizer
    assert (adam.lr, adam.eps) == (1e-3, 1e-8)  # torch.optim.SparseAdam's defaults
    own = load_config(None, ["embedding.optimizer.name=adam", "embedding.optimizer.lr=0.05"])
    assert own.embedding.optimizer.lr == 0.05
    default = load_config(None).embedding.optimizer
    assert (default.name, default.lr) == ("row_wise_adagrad", 0.05)
