"""Replica groups of the torchft contract test (tests/test_ft_torchft.py).

`replica_group` runs one replica group under `recopt.testing.run_on_ranks` (1 rank: a plain
DLRM with fused tables; 2 ranks: the DLRM of ft_sharded_worker sharded row-, table-wise and
data-parallel) on `TorchftManager`, and returns one entry per attempted step: the data position
it trained, whether it committed, its error, and state digests of the rank's model and optimizer
before the step (after the quorum, i.e. any healing), after backward (the fused update) and
after the vote.
`Scenario` says what the group injects: a dropped step, a NaN input, a crash or a hang mid-step,
a wait; and whether the group trains through `TrainPipelineSparseDist` (`_pipelined`: the same
entries, the same injections of a dropped step and a NaN input).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ft_sharded_worker import ROWS, batch
from ft_sharded_worker import build as build_sharded
from torch import nn

from recopt.data.batch import Batch
from recopt.ft.launch import make_fault_tolerant, state_digest
from recopt.ft.retry import RetryPolicy, StepRetrier
from recopt.ft.torchft_manager import TorchftConfig
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.models.dlrm import DLRM, DLRMConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.sharding.train_pipeline import TrainPipelineSparseDist

TIMEOUT = datetime.timedelta(seconds=20)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    replica_id: str
    lighthouse: str
    steps: int
    seed: int
    drop_at: int | None = None  # data position whose first attempt reports an error
    nan_at: int | None = None  # data position whose first attempt has a NaN dense input
    crash_at: int | None = None  # attempt (0-based) at which the process exits after backward
    hang_at: int | None = None  # data position whose first attempt sleeps hang_s after backward
    ready_file: str | None = None  # touched once the manager is built
    waits: tuple[tuple[int, str], ...] = ()  # (step, file): at that step, wait for the file
    marks: tuple[tuple[int, str], ...] = ()  # (step, file): at that step, create the file
    step_sleep: float = 0.0
    hang_s: float = 0.0
    timeout_s: float = TIMEOUT.total_seconds()  # every collective, vote and healing transfer
    min_replica_size: int = 1
    quorum_timeout_s: float = 30.0
    id_map: bool = False  # id-mapped tables (lru, a quarter of the rows; sharded: 2 of 3)
    pipeline: bool = False  # trained by TrainPipelineSparseDist (drop_at and nan_at only)


def build_plain(seed: int, id_map: bool = False) -> tuple[nn.Module, CombinedOptimizer]:
    """The DLRM of ft_sharded_worker on one process (fused Adam tables, dense Adam); with
    ``id_map``, its tables are id-mapped with a quarter of the rows (the maps evict)."""
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=t,
            num_embeddings=n // 4 if id_map else n,
            embedding_dim=8,
            feature_names=(f"f{t}",),
            id_map=IdMapConfig(policy="lru") if id_map else None,
        )
        for t, n in ROWS.items()
    ]
    optimizer = FusedOptimizerConfig(name="adam", lr=0.05, backend=Backend.RECOPT)
    sparse = FusedEmbeddingBagCollection(tables, optimizer=optimizer)
    model = DLRM(sparse, DLRMConfig(dense_in_features=4, bottom_mlp=(8, 8), top_mlp=(8,)))
    dense_params = {
        n: p for n, p in model.named_parameters() if not n.startswith("embedding_bags.")
    }
    dense = KeyedOptimizerWrapper(dense_params, lambda p: torch.optim.Adam(p, lr=0.01))
    return model, CombinedOptimizer([sparse.fused_optimizer, ("dense", dense)])


def _group_store(rank: int) -> tuple[Any, int]:
    """The replica group's TCPStore (what torchrun's MASTER_ADDR/PORT would be)."""
    store = None
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port[0] = store.port
    dist.broadcast(port, 0)
    return store, int(port[0])


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def replica_group(rank: int, world_size: int, spec: Scenario) -> list[dict[str, Any]]:
    """Train until ``spec.steps`` commits; one entry per attempt (see the module docstring)."""
    store, port = _group_store(rank)
    if world_size == 1:
        model, optimizer = build_plain(spec.seed, spec.id_map)
    else:
        model, optimizer = build_sharded(spec.seed, TIMEOUT, spec.id_map)
    config = TorchftConfig(
        replica_id=spec.replica_id,
        lighthouse_addr=spec.lighthouse,
        store_addr="127.0.0.1",
        store_port=port,
        group_rank=rank,
        group_world_size=world_size,
        min_replica_size=spec.min_replica_size,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
        quorum_timeout=datetime.timedelta(seconds=spec.quorum_timeout_s),
    )
    ft = make_fault_tolerant(model, optimizer, config)
    if spec.ready_file and rank == 0:
        Path(spec.ready_file).touch()
    retrier = StepRetrier(ft.manager, RetryPolicy(backoff_s=0.01, max_backoff_s=0.2))
    if spec.pipeline:
        log = _pipelined(model, optimizer, ft, retrier, spec, rank)
        ft.shutdown()
        del store
        return log
    position, log, injected = 0, [], set()
    while ft.manager.current_step() < spec.steps:
        for at, path in spec.waits:
            if ft.manager.current_step() == at:
                _wait_for(path, 120)
        for at, path in spec.marks:
            if ft.manager.current_step() == at and rank == 0:
                Path(path).touch()
        time.sleep(spec.step_sleep)
        ft.optimizer.zero_grad()
        step = ft.manager.current_step()  # healing may have moved it
        before = state_digest(model.state_dict(), optimizer.state_dict())
        dense, sparse = batch(spec.seed, position, rank)
        if spec.nan_at == position and "nan" not in injected:
            dense[0, 0] = float("nan")
            injected.add("nan")
        logits = model(dense, sparse)
        nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(6)).backward()
        if spec.crash_at == len(log) and rank == world_size - 1:
            # Killed mid-step, after the fused update, before the vote: the whole group when
            # it has one rank; one rank of a sharded group (its other rank is then stuck and
            # reaped by run_on_ranks, as torchrun would restart the group).
            os._exit(3)
        if spec.hang_at == position and "hang" not in injected:
            time.sleep(spec.hang_s)  # hung mid-step, still heartbeating: peers time out
            injected.add("hang")
        if spec.drop_at == position and "drop" not in injected:
            ft.manager.report_error(RuntimeError("dropped by the test"))
            injected.add("drop")
        after_backward = state_digest(model.state_dict(), optimizer.state_dict())
        ft.optimizer.step()
        committed = ft.manager.current_step() > step
        error = ft.manager.errored()
        log.append(
            {
                "step": step,
                "position": position,
                "committed": committed,
                "participants": ft.manager.num_participants(),
                "error": None if error is None else type(error).__name__,
                "before": before,
                "after_backward": after_backward,
                "after": state_digest(model.state_dict(), optimizer.state_dict()),
            }
        )
        if retrier.after_step(committed):
            position += 1
    ft.shutdown()
    del store
    return log


class _Attempts:
    """The pipelined group's loss model, data and optimizer in one: it yields the group's
    batches by position, records each attempt as the plain loop does (its digests taken in
    the optimizer's ``zero_grad``, after the quorum, and ``step``, after backward) and injects
    the scenario's NaN input and dropped step at the same points."""

    def __init__(self, model: nn.Module, optimizer: Any, ft: Any, spec: Scenario, rank: int):
        self.model, self.optimizer, self.ft, self.spec, self.rank = model, optimizer, ft, spec, rank
        self.log: list[dict[str, Any]] = []
        self.injected: set[str] = set()
        self.produced = 0

    def __iter__(self) -> _Attempts:
        return self

    def __next__(self) -> Batch:
        dense, sparse = batch(self.spec.seed, self.produced, self.rank)
        if self.spec.nan_at == self.produced:
            dense[0, 0] = float("nan")  # (a NaN step is skipped, never retried)
        self.produced += 1
        return Batch(dense, sparse, torch.ones(6), self.produced - 1)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.log[-1]["position"] = batch.position
        logits = self.model(batch.dense, batch.sparse)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits

    def zero_grad(self) -> None:
        self.ft.optimizer.zero_grad()
        self.log.append(
            {
                "step": self.ft.manager.current_step(),
                "before": state_digest(self.model.state_dict(), self.optimizer.state_dict()),
            }
        )

    def step(self) -> None:
        entry = self.log[-1]
        if self.spec.drop_at == entry["position"] and "drop" not in self.injected:
            self.ft.manager.report_error(RuntimeError("dropped by the test"))
            self.injected.add("drop")
        entry["after_backward"] = state_digest(self.model.state_dict(), self.optimizer.state_dict())
        self.ft.optimizer.step()
        error = self.ft.manager.errored()
        entry["committed"] = self.ft.manager.current_step() > entry["step"]
        entry["participants"] = self.ft.manager.num_participants()
        entry["error"] = None if error is None else type(error).__name__
        entry["after"] = state_digest(self.model.state_dict(), self.optimizer.state_dict())


class _LossOf(nn.Module):
    def __init__(self, attempts: _Attempts) -> None:
        super().__init__()
        self.inner = attempts.model  # (its sharded collections are found through it)
        self.attempts = attempts

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attempts.loss(batch)


def _pipelined(
    model: nn.Module, optimizer: Any, ft: Any, retrier: StepRetrier, spec: Scenario, rank: int
) -> list[dict[str, Any]]:
    """The scenario's steps through `TrainPipelineSparseDist`: batch i+1 distributed (and its
    ids routed to their owner shards) while batch i trains; a dropped step keeps its batch at
    the head of the pipeline and trains it again from the ids already distributed."""
    attempts = _Attempts(model, optimizer, ft, spec, rank)
    pipeline = TrainPipelineSparseDist(
        _LossOf(attempts),
        attempts,  # type: ignore[arg-type]  # zero_grad and step, what the pipeline calls
        "cpu",
        step_committed=lambda: retrier.after_step(attempts.log[-1]["committed"]),
        timeout=TIMEOUT,
    )
    assert pipeline.sharded or pipeline.remapping  # the stages it runs ahead were found
    while ft.manager.current_step() < spec.steps:
        pipeline.progress(attempts)
    return attempts.log
