"""Train DLRM / DCNv2 on the embedded synthetic click log or Criteo TSV files, on 1..N ranks.

    python examples/dlrm/train.py                                  # built-in small config
    python examples/dlrm/train.py --config configs/dlrm_small.toml --set training.steps=300
    torchrun --nproc-per-node 2 examples/dlrm/train.py --config configs/dlrm_small.toml
    python examples/dlrm/train.py --config ... --resume      # continue from the last checkpoint
    TORCHFT_LIGHTHOUSE=http://host:29510 REPLICA_GROUP_ID=group0 \
        torchrun --nproc-per-node 1 examples/dlrm/train.py --fault-tolerant   # one replica group

Sparse tables train with their fused optimizer (the update runs inside backward), the MLPs
with a torch optimizer; both sit in one CombinedOptimizer under warmup and gradient clipping.
Rank 0 draws a progress bar, appends metrics to ``<output_dir>/metrics.jsonl`` and, at the
end, draws ``<output_dir>/curves.png``. With ``--fault-tolerant`` each torchrun is one replica
group of a fault-tolerant job (docs/fault_tolerance.md): steps commit only when every live
group agrees, and a restarted group heals from a peer.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dlrm_agree import check_same_config  # noqa: E402
from dlrm_build import (  # noqa: E402
    RunEnv,
    build_data,
    build_model,
    build_optimizer,
    shard_model,
)
from dlrm_config import (  # noqa: E402
    TrainingConfig,
    fault_tolerant_config,
    load_config,
    parse_args,
)
from dlrm_id_map import IdMapWindow  # noqa: E402
from dlrm_nonfinite import NonFiniteSteps, poison_if_nonfinite  # noqa: E402
from dlrm_pipeline import build_pipeline, phase_milliseconds  # noqa: E402
from dlrm_report import MetricsLog, ProgressBar, plot_curves  # noqa: E402
from dlrm_resume import check_writable_root, find_resume_point  # noqa: E402
from dlrm_validate import evaluate  # noqa: E402

from recopt import comm  # noqa: E402
from recopt.checkpoint import CheckpointManager, load, read_manifest  # noqa: E402
from recopt.data import Batch  # noqa: E402
from recopt.data.prefetch import DevicePrefetcher  # noqa: E402
from recopt.ft.launch import (  # noqa: E402
    fault_tolerance_config_from_env,
    make_fault_tolerant,
    state_digest,
)
from recopt.ft.retry import RetryPolicy, StepRetrier  # noqa: E402
from recopt.ft.torchft_manager import TorchftConfig  # noqa: E402
from recopt.metrics import click_metrics  # noqa: E402


def default_threads(env: RunEnv) -> int:
    """This machine's cores shared among the ranks on it (torchrun's LOCAL_WORLD_SIZE)."""
    local_ranks = env.local_world_size or env.world_size
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def _env_from_environ() -> RunEnv:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = comm.device_for_local_rank(local_rank, use_cuda=torch.cuda.is_available())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    return RunEnv(rank, world_size, local_rank, device, local_world)


# ---------------------------------------------------------------------------------------------
# Training and validation
# ---------------------------------------------------------------------------------------------


class Trainer:
    """The loop: steps, windowed training metrics, periodic validation and checkpoints."""

    def __init__(
        self,
        config: TrainingConfig,
        env: RunEnv,
        model: nn.Module,
        ft_config: TorchftConfig | None = None,
        *,
        resume: bool | str = False,
        overwrite_checkpoints: bool = False,
    ) -> None:
        self.config = config
        self.resume_from = resume if isinstance(resume, str) else None  # --resume PATH
        self.env = env
        self.model = model
        self.base_optimizer = build_optimizer(model, config)  # what checkpoints hold
        # The loop's optimizer: the base one, or its fault-tolerant wrapper.
        self.optimizer: torch.optim.Optimizer = self.base_optimizer
        self.ft = None
        self.retrier: StepRetrier | None = None  # retries a dropped step's batch
        if ft_config is not None:
            # PLUG-IN (fault tolerance): the wrapper's zero_grad joins the step's quorum (and
            # may heal this group), its step averages, votes and commits or rolls back.
            ft = config.fault_tolerance
            self.ft = make_fault_tolerant(
                model,
                self.base_optimizer,
                ft_config,
                sync_embeddings=ft.sync_embeddings,
            )
            self.optimizer = self.ft.optimizer
            policy = RetryPolicy(max_consecutive_failures=ft.max_consecutive_failures)
            self.retrier = StepRetrier(self.ft.manager, policy)
        self._set_up_loop()
        self.metrics = click_metrics().to(env.device)
        self.loss_mean = torchmetrics.MeanMetric().to(env.device)
        self.window_finite_steps = 0  # steps in the metrics window that were not skipped
        self.nonfinite = NonFiniteSteps(
            model,
            self.base_optimizer,
            config.training.max_consecutive_nonfinite,
            [
                ("embedding.optimizer.lr", config.embedding.optimizer.lr),
                ("dense_optimizer.lr", config.dense_optimizer.lr),
            ],
        )
        self.step = 0
        self.samples = 0  # training samples all ranks consumed (continues across resumes)
        self.saved_step = 0  # the step of the newest checkpoint (loaded or written)
        out = config.training.output_dir
        self.log: MetricsLog | None = None  # made once the checkpoint directory is accepted
        self.bar = ProgressBar(config.training.steps) if env.is_main else None
        self.id_maps = IdMapWindow(model)
        data = config.data
        if data.source == "criteo" and not data.criteo.val_paths and data.val_batches:
            self._say(
                "data.criteo.val_paths is empty: this run validates nothing; give held-out "
                "files (--set 'data.criteo.val_paths=[\"day_23.tsv\"]') to validate, or set "
                "data.val_batches=0 to say that none is wanted"
            )
        # PLUG-IN (checkpoints): atomic step_<N> directories, the newest `keep` kept.
        ckpt = config.checkpoint
        root = ckpt.dir or os.path.join(out, "checkpoints")
        check_writable_root(Path(root))  # e.g. recopt-reshard's output: --resume it instead
        self.checkpoints = CheckpointManager(
            root,
            keep_last=ckpt.keep,
            timeout=datetime.timedelta(seconds=config.training.timeout_s),
            resume=bool(resume),
            overwrite=overwrite_checkpoints,
        )
        if env.is_main:  # a new run starts its own records; a resumed one continues them
            self.log = MetricsLog(os.path.join(out, "metrics.jsonl"), fresh=not resume)

    def _set_up_loop(self) -> None:
        """The training stream and the loop over it.

        Pipelined (default): batch i+1's ids are distributed and batch i+2 copied while
        batch i trains; ``train_data`` is then the position after the last batch trained.
        Plain loop: on a GPU the next batch is pinned and copied on a side stream.
        """
        config, env = self.config, self.env
        train_source = build_data(config, env, "train")
        if train_source is None:
            raise ValueError(f"data.source {config.data.source!r} has no training data configured")
        self.pipeline = None
        if config.training.pipeline:
            self.train_source = train_source
            self.pipeline, self.train_data = build_pipeline(
                self.model,
                self.optimizer,
                self.train_source,
                env.device,
                config.training.timeout_s,
                step_committed=None if self.retrier is None else self._pipeline_step_committed,
                remap_threads=config.training.remap_threads,
            )
        else:
            self.train_data = DevicePrefetcher(train_source, env.device)

    def resume(self) -> None:
        """Loads the newest finite checkpoint of the run's directory, or of ``--resume PATH``
        (a step folder is loaded as it is): weights, optimizer, data position and step.

        Raises:
            ValueError: ``--resume PATH`` names no checkpoint, or only NaN/inf ones.
        """
        self.base_optimizer.init_state()  # lazily created state must exist to be loaded in place
        source = Path(self.resume_from) if self.resume_from else self.checkpoints.root
        point = find_resume_point(source)
        if point is None:
            if self.resume_from:
                raise ValueError(
                    f"--resume {source}: no checkpoint there (neither a checkpoint with its "
                    f"manifest.json nor a folder of complete step_<N> checkpoints); name a "
                    "step folder, a checkpoints folder, or give --resume alone"
                )
            self._say(f"--resume: no checkpoint yet in {source}, starting from step 0")
            if self.log is not None:
                self.log.resumed(0)  # (an earlier attempt's records are not this run's)
            return
        if point.skipped_nonfinite:
            names = ", ".join(p.name for p in point.skipped_nonfinite)
            self._say(f"--resume: skipped {names} (NaN/inf weights or optimizer state)")
        timeout = datetime.timedelta(seconds=self.config.training.timeout_s)
        extras = load(
            point.path,
            self.model,
            self.base_optimizer,
            extra={"data": self.train_data},
            timeout=timeout,
        )
        manifest_step = read_manifest(point.path).step
        self.step = int(extras.get("step", manifest_step or 0))
        self.saved_step = self.step if point.path.parent == self.checkpoints.root else -1
        self.samples = int(extras.get("samples", 0))
        self._say(f"resumed from step {self.step} ({self.samples} samples seen) of {point.path}")
        if self.log is not None:
            self.log.resumed(self.step)

    def save(self) -> None:
        self.checkpoints.save(
            self.step,
            self.model,
            self.base_optimizer,
            extra={"data": self.train_data, "step": self.step, "samples": self.samples},
        )
        self.saved_step = self.step

    def train_batch(self, batch: Batch) -> None:
        """Trains ``batch``; under fault tolerance a dropped step retries the same batch.

        The retrier backs off between attempts, skips a batch whose step was dropped for a
        NaN/inf gradient, and raises after too many failures in a row or a permanent error.
        """
        while not self.train_step(batch):
            if self.retrier is None or self.retrier.after_step(False):
                return
        if self.retrier is not None:
            self.retrier.after_step(True)

    def train_step(self, batch: Batch) -> bool:
        """One attempt at a step on ``batch``; True if it committed."""
        self.model.train()
        # First: under fault tolerance this is the step's quorum, which may heal (replace) the
        # weights, and the embedding guard snapshots rows in the forward that follows.
        self.optimizer.zero_grad()
        start = self.ft.manager.current_step() if self.ft is not None else 0
        logits = self.model(batch.dense, batch.sparse)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        # the embedding rows are updated here, by the fused optimizer
        poison_if_nonfinite(loss, batch.dense).backward()
        self.optimizer.step()
        committed = self.ft is None or self.ft.manager.current_step() > start
        return self.step_done(loss, logits, batch.labels, committed)

    def _committed_past_step(self) -> bool:
        """Whether the step just run moved the committed step past ``self.step`` (always
        without fault tolerance; a heal may jump further)."""
        return self.ft is None or self.ft.manager.current_step() > self.step

    def _pipeline_step_committed(self) -> bool:
        """The pipeline's hook after each step under fault tolerance: False keeps the batch
        at the head of the pipeline to be retried (a dropped step), True moves on (committed,
        or given up by the retrier: a NaN/inf step)."""
        assert self.retrier is not None
        if self._committed_past_step():
            self.retrier.after_step(True)
            return True
        return self.retrier.after_step(False)

    def step_done(
        self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, committed: bool
    ) -> bool:
        """After a step: the NaN/inf bookkeeping, then the window's metrics; returns
        ``committed``."""
        ft_error = self.ft.manager.errored() if self.ft is not None else None
        if self.nonfinite.step_done(self.step + 1, ft_error):  # raises after too many
            if self.nonfinite.in_a_row == 1:
                self._say(
                    f"step {self.step + 1}: NaN/inf loss or gradient, nothing updated "
                    f"({self.nonfinite.total} such step(s) so far)"
                )
            return committed  # a NaN loss or logit would spoil the window's metrics
        if not committed:
            return False  # dropped: the retried batch is counted when it commits
        self.window_finite_steps += 1
        self.id_maps.after_step()
        with torch.no_grad():
            self.metrics.update(torch.sigmoid(logits), labels.long())
            self.loss_mean.update(loss.detach(), weight=labels.numel())
        return committed

    def run(self) -> dict[str, float]:
        """Trains to ``training.steps``; returns the last validation metrics."""
        cfg = self.config.training
        window_start, window_samples = time.perf_counter(), 0
        last_val: dict[str, float] = {}
        validated_at = -1
        batches = self._batches() if self.step < cfg.steps else iter(())  # resumed at the end
        for samples in batches:
            committed = self.step + 1 if self.ft is None else self.ft.manager.current_step()
            if committed == self.step:
                continue  # dropped for a NaN/inf gradient by the replica groups' vote
            self.step = committed  # a heal may jump ahead to the peer's step
            window_samples += samples * self.env.world_size
            self.samples += samples * self.env.world_size
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                rate = window_samples / max(time.perf_counter() - window_start, 1e-9)
                self._report_train(rate)
                window_start, window_samples = time.perf_counter(), 0
            paused = time.perf_counter()  # validation and checkpoints: not in samples/s
            if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps:
                last_val, validated_at = self.validate(), self.step
            if self.config.checkpoint.every and self.step % self.config.checkpoint.every == 0:
                self.save()
            window_start += time.perf_counter() - paused
            if self.step >= cfg.steps:
                break
        if validated_at != self.step:  # the data ran out before training.steps
            last_val = self.validate()
        if self.config.checkpoint.every and self.saved_step != self.step:
            self.save()  # the steps after the last scheduled checkpoint are kept too
        if self.bar is not None:
            self.bar.close()
        if self.ft is not None:
            self._write_digest()
        return last_val

    def _write_digest(self) -> None:
        """``<output_dir>/state_digest.json``: replica groups that agree have equal digests."""
        if not self.env.is_main:
            return
        digest = state_digest(self.model.state_dict(), self.base_optimizer.state_dict())
        path = os.path.join(self.config.training.output_dir, "state_digest.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"step": self.step, "sha256": digest}, f)
        self._say(f"fault tolerance: step {self.step}, state sha256 {digest[:16]}")

    def _batches(self) -> Iterator[int]:
        """Trains batches until the data ends, in lockstep across ranks; yields each one's
        sample count after its step."""
        if self.pipeline is None:
            for batch in self.train_data:  # already on the device (DevicePrefetcher)
                self.train_batch(batch)
                yield batch.labels.numel()
        else:
            while True:
                self.model.train()
                try:
                    loss, logits, labels = self.pipeline.progress(self.train_source)
                except StopIteration:
                    break
                committed = self._committed_past_step()
                self.step_done(loss, logits, labels, committed)
                yield labels.numel()
        if self.step < self.config.training.steps:
            epochs = self.config.training.epochs
            self._say(
                f"training data exhausted after {self.step} steps ({epochs} epoch(s), "
                f"training.steps {self.config.training.steps}); raise training.epochs to "
                "pass over the data again"
            )

    def _report_train(self, samples_per_s: float) -> None:
        values: dict[str, float] = {}
        if self.window_finite_steps:  # else: every step of the window was skipped
            values = {k: float(v) for k, v in self.metrics.compute().items()}
            values["loss"] = float(self.loss_mean.compute())
        self.metrics.reset()
        self.loss_mean.reset()
        self.window_finite_steps = 0
        id_map_values, id_map_line = self.id_maps.take()
        if self.log is not None and self.bar is not None:
            record = {**values, "samples_per_s": samples_per_s, "samples": self.samples}
            record.update(id_map_values)
            record["skipped_nonfinite"] = self.nonfinite.total
            if self.pipeline is not None:  # per step, this window
                record.update(phase_milliseconds(self.pipeline))
            self.log.write(self.step, "train", record)
            shown = {k: values[k] for k in ("loss", "auc", "ne") if k in values}
            self.bar.update(
                self.step, samples_per_s, shown, skipped=self.nonfinite.total, extra=id_map_line
            )

    def validate(self) -> dict[str, float]:
        """Metrics over ``data.val_batches`` held-out batches (the same ones every time)."""
        clock = self.samples // self.config.data.batch_size  # a drifting source's clock
        values = evaluate(self.model, self.config, self.env, clock)
        if not values:
            return values
        if self.log is not None:
            self.log.write(self.step, "val", values)
        self._say(
            f"validation at step {self.step}: "
            + " ".join(f"{k} {v:.4f}" for k, v in sorted(values.items()))
        )
        return values

    def _say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.message(text)

    def finish(self) -> None:
        """Draws the curves (rank 0), or says in one line why not."""
        if self.log is None or not self.config.training.plot:
            return
        path = os.path.join(self.config.training.output_dir, "curves.png")
        notice = plot_curves(self.log.records, path)
        self._say(notice or f"curves: {path}")


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def train(
    config: TrainingConfig,
    env: RunEnv,
    resume: bool | str = False,
    ft_config: TorchftConfig | None = None,
    overwrite_checkpoints: bool = False,
) -> dict[str, float]:
    """Builds everything and trains; returns the final validation metrics.

    Args:
        config: the run.
        env: this process's rank and device.
        resume: continue from the newest finite checkpoint (True), or from a path: a step
            folder or a checkpoints folder.
        ft_config: this replica group's fault-tolerance manager settings, or None.
        overwrite_checkpoints: replace another run's checkpoints in the checkpoint directory
            (without it, or ``resume``, such a directory is refused).

    Raises:
        ValueError: ``resume`` together with fault tolerance (a restarted replica group heals
            from a live peer instead).
    """
    if ft_config is not None:
        if resume:
            raise ValueError(
                "--resume and --fault-tolerant together: a restarted replica group heals from "
                "a live peer; drop --resume (checkpoints restart the whole job, without "
                "--fault-tolerant)"
            )
        config = fault_tolerant_config(config)
    check_same_config(config, datetime.timedelta(seconds=config.training.timeout_s))
    torch.set_num_threads(config.training.num_threads or default_threads(env))
    torch.set_float32_matmul_precision(config.training.matmul_precision)
    # On N ranks the tables are built on the meta device: each rank allocates its shards only.
    model = shard_model(
        build_model(config, env.device, embeddings_on_meta=env.world_size > 1), config, env
    )
    trainer = Trainer(
        config,
        env,
        model,
        ft_config,
        resume=resume,
        overwrite_checkpoints=overwrite_checkpoints,
    )
    try:
        if resume:
            trainer.resume()
        result = trainer.run()
        trainer.finish()
    finally:
        trainer.checkpoints.close()
        if trainer.log is not None:
            trainer.log.close()
        if trainer.ft is not None:
            trainer.ft.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    """Runs the script; returns 0, or 2 for a config error (one line naming the key). A failure
    on any rank is reported with its rank and raised."""
    args = parse_args(argv, __doc__)
    try:
        config = load_config(args.config, args.set)
    except ValueError as err:  # a config error: one line naming the key, no traceback
        sys.stderr.write(f"train.py: error: {err}\n")
        return 2
    env = _env_from_environ()
    ft_config = None
    if args.fault_tolerant:
        timeout = datetime.timedelta(seconds=config.fault_tolerance.timeout_s)
        ft_config = fault_tolerance_config_from_env(os.environ, timeout=timeout)
    if env.world_size > 1:  # on CUDA: NCCL, and gloo beside it for CPU-side collectives
        # torchrun --max-restarts keeps its store across attempts: each attempt its own keys.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        comm.init_process_group(
            env.device,
            timeout=datetime.timedelta(seconds=config.training.timeout_s),
            store_prefix=f"recopt/attempt{attempt}/",
        )
    elif env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    try:
        train(
            config,
            env,
            resume=args.resume,
            ft_config=ft_config,
            overwrite_checkpoints=args.overwrite_checkpoints,
        )
    except BaseException as err:
        sys.stderr.write(
            f"[rank {env.rank}/{env.world_size}] training failed: {type(err).__name__}: {err}\n"
        )
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
