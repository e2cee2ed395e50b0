"""The DLRM script's --fault-tolerant on torchft: its settings, and a dropped step's batch retried.

The script runs in this process as one replica group (a torchft lighthouse started here, the
group's TCPStore as torchrun would provide it); one vote is made to fail, and the step after
it must train the same batch, so the run sees every batch once.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import pathlib
import sys
from typing import Any

import pytest

from recopt.ft.launch import fault_tolerance_config_from_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_config  # noqa: E402
import dlrm_pipeline  # noqa: E402
import train as dlrm_train  # noqa: E402

TORCHFT_ENV = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "REPLICA_GROUP_ID": "g0"}


def test_without_torchft_fault_tolerant_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'recopt\[ft\]'"):
        fault_tolerance_config_from_env({**TORCHFT_ENV, "MASTER_PORT": "29500"})


def test_settings_from_the_environment() -> None:
    pytest.importorskip("torchft")
    env = {**TORCHFT_ENV, "MASTER_ADDR": "node3", "MASTER_PORT": "29500", "RANK": "1"}
    config = fault_tolerance_config_from_env({**env, "WORLD_SIZE": "2"})
    assert (config.store_addr, config.store_port, config.group_rank) == ("node3", 29500, 1)
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE is not set"):
        fault_tolerance_config_from_env({"REPLICA_GROUP_ID": "g0"})
    # Without torchrun a one-process group starts its own store (port 0); a larger group
    # needs torchrun's.
    assert fault_tolerance_config_from_env(TORCHFT_ENV).store_port == 0
    with pytest.raises(ValueError, match="MASTER_PORT=''.*torchrun"):
        fault_tolerance_config_from_env({**TORCHFT_ENV, "WORLD_SIZE": "2"})
    # recopt's retired lighthouse is refused, naming what to set instead.
    old = {"RECOPT_FT_LIGHTHOUSE": "127.0.0.1:1", "RECOPT_FT_REPLICA_ID": "g0"}
    with pytest.raises(ValueError, match="RECOPT_FT_LIGHTHOUSE.*retired.*TORCHFT_LIGHTHOUSE"):
        fault_tolerance_config_from_env(old)
    with pytest.raises(ValueError, match="max_consecutive_failures must be >= 1"):
        dlrm_config.load_config(None, ["fault_tolerance.max_consecutive_failures=0"])


def _argv(out: pathlib.Path, steps: int) -> list[str]:
    sets = [
        f"training.steps={steps}",
        "training.log_every=1",
        f"training.output_dir={out}",
        "training.plot=false",
        "training.num_threads=1",
        "data.batch_size=32",
        "data.val_batches=0",
        "checkpoint.every=0",
    ]
    return [arg for item in sets for arg in ("--set", item)]


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
def test_a_dropped_step_retrains_the_same_batch(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, pipeline: bool
) -> None:
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    from recopt.ft.torchft_manager import TorchftConfig, TorchftManager

    votes = {"n": 0}
    real_vote = TorchftManager._vote

    def flaky_vote(self: TorchftManager, ok: bool) -> bool:
        votes["n"] += 1
        if votes["n"] == 3:  # the third step's vote is lost: the step is dropped
            self.report_error(TimeoutError("vote lost by the test"))
        return real_vote(self, ok and votes["n"] != 3)

    attempts: list[tuple[int, bool]] = []
    monkeypatch.setattr(TorchftManager, "_vote", flaky_vote)
    if pipeline:  # the batch each forward sees, and the pipeline's commit hook's answers
        trained: list[int] = []
        real_forward = dlrm_pipeline.LossAndLogits.forward
        real_hook = dlrm_train.Trainer._pipeline_step_committed

        def recorded_forward(self: Any, batch: Any) -> Any:
            trained.append(id(batch))
            return real_forward(self, batch)

        def recorded_hook(self: Any) -> bool:
            committed = self.ft.manager.current_step() > self.step
            attempts.append((trained[-1], committed))
            return real_hook(self)

        monkeypatch.setattr(dlrm_pipeline.LossAndLogits, "forward", recorded_forward)
        monkeypatch.setattr(dlrm_train.Trainer, "_pipeline_step_committed", recorded_hook)
    else:
        real_step = dlrm_train.Trainer.train_step

        def recorded_step(self: Any, batch: Any) -> bool:
            committed = real_step(self, batch)
            attempts.append((id(batch), committed))
            return committed

        monkeypatch.setattr(dlrm_train.Trainer, "train_step", recorded_step)
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        port = int(server.address().rsplit(":", 1)[1])
        ft = TorchftConfig(  # store_port 0: the manager starts the group's store, no torchrun
            replica_id="solo",
            lighthouse_addr=f"http://127.0.0.1:{port}",
            store_addr="127.0.0.1",
            store_port=0,
            timeout=datetime.timedelta(seconds=20),
        )
        out = tmp_path / "run"
        sets = [*_argv(out, 5)[1::2], f"training.pipeline={str(pipeline).lower()}"]
        config = dlrm_config.load_config(None, sets)
        dlrm_train.train(config, dlrm_train.RunEnv(), ft_config=ft)
    finally:
        server.shutdown()
    assert [c for _, c in attempts] == [True, True, False, True, True, True]
    assert attempts[2][0] == attempts[3][0]  # the dropped step's batch, trained again
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [r["step"] for r in map(json.loads, lines) if r["split"] == "train"]
    assert steps == [1, 2, 3, 4, 5]
