"""The DLRM script as a new user meets it: TensorBoard events beside the JSONL, and messages
that point to the fix (Criteo's 26-table config, validation without val_paths)."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_report  # noqa: E402
import train as dlrm_train  # noqa: E402
from test_dlrm import _criteo_args, small_run  # noqa: E402


def _records(out: pathlib.Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _scalars(events_dir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the events files in ``events_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events_dir))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def _same(a: float, b: float) -> bool:
    # TensorBoard stores float32: equal to the JSONL's float64 up to that rounding.
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30)


def test_metrics_are_tensorboard_events_equal_to_the_jsonl(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("tensorboard", reason="the recopt[tensorboard] extra is not installed")
    out = tmp_path / "run"
    argv = small_run(out, 50, "--set", "training.eval_every=25", "--set", "data.val_batches=2")
    assert dlrm_train.main(argv) == 0
    scalars = _scalars(out / dlrm_report.TENSORBOARD_DIR)
    want: dict[str, list[tuple[int, float]]] = {}
    for record in _records(out):
        for name, value in record.items():
            if name not in ("step", "split", "time_s"):
                want.setdefault(f"{record['split']}/{name}", []).append((record["step"], value))
    assert {"train/loss", "train/auc", "val/auc", "val/ne"} <= set(want)
    assert sorted(scalars) == sorted(want)
    for tag, series in want.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in series], tag
        assert all(_same(g, w) for (_, g), (_, w) in zip(got, series, strict=True)), tag
    assert [s for s, _ in scalars["val/auc"]] == [25, 50]


def test_the_jsonl_is_strict_json_an_undefined_value_null(tmp_path: pathlib.Path) -> None:
    """A NaN or inf value (the entropy of a one-class batch) is written as null: strict JSON
    parsers refused the bare NaN token."""
    log = dlrm_report.MetricsLog(str(tmp_path / "metrics.jsonl"), tensorboard=False)
    log.write(3, "val", {"loss": 0.5, "ne": float("nan"), "auc": float("inf")})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    record = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name}"))
    assert record["loss"] == 0.5 and record["ne"] is None and record["auc"] is None


def test_the_records_of_a_resumed_run_continue_and_a_new_run_starts_its_own(
    tmp_path: pathlib.Path,
) -> None:
    """Resumed: the earlier records up to the checkpoint are kept (the final plot showed only
    the resumed part), those past it dropped (their steps are trained again). A new run into
    the same directory starts its own file (it used to append to the old run's)."""
    path = tmp_path / "metrics.jsonl"
    log = dlrm_report.MetricsLog(str(path), tensorboard=False)
    for step in (5, 10, 15):
        log.write(step, "train", {"loss": 1.0 / step})
    log.close()
    resumed = dlrm_report.MetricsLog(str(path), tensorboard=False)
    resumed.resumed(10)
    resumed.write(15, "train", {"loss": 0.5})
    assert [r["step"] for r in resumed.records] == [5, 10, 15]
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [0.2, 0.1, 0.5]
    fresh = dlrm_report.MetricsLog(str(path), tensorboard=False, fresh=True)
    fresh.write(1, "train", {"loss": 2.0})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


def test_without_tensorboard_only_the_jsonl_is_written(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    log = dlrm_report.MetricsLog(str(tmp_path / "metrics.jsonl"))
    assert log.events is None
    log.write(3, "train", {"loss": 0.5})
    log.close()
    assert _records(tmp_path) == [
        {"step": 3, "split": "train", "time_s": pytest.approx(0, abs=60), "loss": 0.5}
    ]
    assert not (tmp_path / dlrm_report.TENSORBOARD_DIR).exists()


def test_criteo_with_the_default_config_points_to_the_26_table_config(
    tmp_path: pathlib.Path,
) -> None:
    args = _criteo_args(tmp_path, 40, 2)[:-4]  # without its own 26 tables: the default 8
    with pytest.raises(ValueError, match=r"look up 8 features.*configs/dlrm_criteo_shape\.toml"):
        dlrm_train.main(args)


def test_criteo_library_error_says_what_to_give() -> None:
    from recopt.data import CriteoClickLog

    with pytest.raises(ValueError, match=r"got 8 feature_names .* 26 of each"):
        CriteoClickLog(["x.tsv"], [f"f{i}" for i in range(8)], [10] * 8, 4)


def test_criteo_without_val_paths_says_validation_is_off(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _criteo_args(tmp_path, 40, 2, "--set", "data.val_batches=2")
    assert dlrm_train.main(args) == 0
    assert "data.criteo.val_paths is empty: this run validates nothing" in capsys.readouterr().err
    assert not [r for r in _records(tmp_path / "out") if r["split"] == "val"]
    # No notice when no validation was asked for.
    assert dlrm_train.main(_criteo_args(tmp_path / "quiet", 40, 2)) == 0
    assert "val_paths is empty" not in capsys.readouterr().err
