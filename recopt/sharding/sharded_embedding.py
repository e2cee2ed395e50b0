"""ShardedEmbeddingBagCollection: the sharded twin of FusedEmbeddingBagCollection.

One engine for every sharding type (docs/sharding.md): ids go to the rectangles that hold their
rows (`input_dist`), each rank pools its rectangles with one kernel per optimizer, the pooled
partials go back to their source rank, which adds them into the feature's columns
(`output_assembly`). Backward sends the output gradients the reverse way; the kernels update
their rows in place.
Legend: B this rank's batch, Bm the largest batch, W world size, D output width.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recopt.comm import all_ranks_finite, broadcast
from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.contract import Kernel
from recopt.kernels.factory import KernelRequest, create_kernel, rng_unchanged
from recopt.modules.collection import FusedCollection
from recopt.modules.config import EmbeddingBagConfig, validate_tables
from recopt.modules.fused_groups import LearningRateSync, resolve_table_optimizers
from recopt.modules.id_map_lookup import IdMaps
from recopt.modules.nonfinite import NonFiniteGradGuard, backward_if_given, finite_flag
from recopt.modules.prefetch import PrefetchQueue
from recopt.modules.variable_batch import expand_rows
from recopt.sharding.backend_decisions import share_backend_decisions
from recopt.sharding.bucketizer import Bucketizer
from recopt.sharding.id_map_sharded import ShardedIdMaps
from recopt.sharding.input_dist import ReceivedInput
from recopt.sharding.input_stage import DistributedInput, start_distribution
from recopt.sharding.kernel_inputs import KernelInput, kernel_inputs, run_kernel, send_buffer
from recopt.sharding.layout import GroupLayout, ShardedLayout
from recopt.sharding.output_assembly import OutputAssembly
from recopt.sharding.output_exchange import ExchangeMeta, OutputExchange, ScratchBuffer
from recopt.sharding.plan import ParameterSharding, PlanError, ShardingPlan
from recopt.sharding.plan_validation import validate_plan
from recopt.sharding.row_stats import RowStatExchange
from recopt.sharding.state import ShardedFusedOptimizer, ShardedState
from recopt.sparse import KeyedJaggedTensor, KeyedTensor

Tensor = torch.Tensor
# The default bound of the skip vote of a backward pass: every rank is already in backward, so
# it only bounds the wait for a peer that died or hangs.
AGREE_TIMEOUT = datetime.timedelta(minutes=5)


def _check_placements(
    shardings: Mapping[str, ParameterSharding], device: torch.device, module_path: str
) -> None:
    """UVM placements need CUDA: refuse them on every rank alike, before any collective."""
    for name, ps in shardings.items():
        if not ps.placement.on_device and device.type != "cuda":
            raise PlanError(
                f"table {name!r} (module {module_path!r}): placement "
                f"{ps.placement.describe()!r} needs a CUDA device (UVM is CUDA memory), but "
                f"the module is on {device.type!r}; use placement 'device' there"
            )


class ShardedEmbeddingBagCollection(nn.Module, FusedCollection):
    """A FusedEmbeddingBagCollection whose tables are split over ranks by a sharding plan.

    Same input (this rank's batch) and output (its pooled ``KeyedTensor``) as the unsharded
    module; batch sizes may differ between ranks. Every rank must call ``forward`` and
    ``backward`` together. ``state_dict()`` holds ``embedding_bags.<t>.weight`` as a
    ShardedTensor of the table's global shape (a plain tensor for data-parallel tables).

    A feature may look up several tables, as in the fused collection: its outputs are keyed
    ``feature@table``, and each of its lookups is distributed as a feature of its own.

    A backward whose output gradient holds NaN or inf on ANY rank updates nothing on every
    rank (no weight, state or step counter): the ranks agree with one all-reduce of a flag
    before the output exchange's backward, so every rank skips the same collectives. Such
    steps are counted in ``skipped_nonfinite_steps`` on every rank (one warning, the first time).

    Args:
        tables: the tables.
        shardings: table name -> `ParameterSharding` (checked with `validate_plan`).
        optimizer: the fused optimizer of tables whose sharding names none.
        table_optimizers: per-table optimizers (the plan's ``optimizer`` takes precedence).
        is_weighted: the input carries one weight per id.
        process_group: the ranks (default: the world).
        device: where the shards live.
        module_path: the module's path in the model, for error messages.
        skip_nonfinite: the check above (one 1-element all-reduce and one host read per
            backward). Not applied while a kernel has a ``grad_hook`` (fault tolerance): the
            hook's collectives need every replica group to run its kernels' backward; there the
            hook reports a non-finite gradient and the step is dropped everywhere instead.
        timeout: limit of that check's all-reduce.
        param_prefix: state-dict and fused-optimizer names are ``<prefix>.<table>.weight`` (an
            embedding collection's lookup engine passes ``embeddings``).
        plan_validated: the caller validated ``shardings`` against these tables and this
            world size (`DistributedModelParallel` validates the whole plan once).

    Raises:
        ValueError: invalid tables; ``PlanError`` for an invalid plan or an unsupported
            optimizer/sharding pair.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        shardings: Mapping[str, ParameterSharding],
        optimizer: FusedOptimizerConfig | None = None,
        table_optimizers: Mapping[str, FusedOptimizerConfig] | None = None,
        is_weighted: bool = False,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        module_path: str = "",
        skip_nonfinite: bool = True,
        timeout: datetime.timedelta = AGREE_TIMEOUT,
        *,
        param_prefix: str = "embedding_bags",
        plan_validated: bool = False,
    ) -> None:
        super().__init__()
        self._param_prefix = param_prefix
        validate_tables(tables, allow_shared_features=True)
        self.tables: list[EmbeddingBagConfig] = list(tables)
        self.is_weighted = is_weighted
        self.device = torch.device(device if device is not None else "cpu")
        self._pg = process_group
        self._rank = dist.get_rank(process_group)
        world = dist.get_world_size(process_group)
        if not plan_validated:  # pure and identical on every rank, before any collective
            validate_plan(
                ShardingPlan({module_path: dict(shardings)}), {module_path: self.tables}, world
            )
        _check_placements(shardings, self.device, module_path)
        planned = {t.name: shardings[t.name].optimizer for t in self.tables}
        optimizers = resolve_table_optimizers(self.tables, optimizer, table_optimizers, planned)
        self._layout = ShardedLayout(
            self.tables, shardings, optimizers, world, self._rank, module_path
        )
        features = self._layout.features
        self._bucketizer = Bucketizer(
            features.num_rows,
            self._layout.dest_features,
            self._layout.dp_features,
            self.device,
            hashed=[self.tables[t].id_map is not None for t in features.feature_table],
        )
        self._build_kernels(timeout)
        self._dummy = torch.zeros(0, device=self.device, requires_grad=True)
        self._state = ShardedState(
            self._layout,
            self._mp_kernels,
            self._dp_kernels,
            self._pg,
            self.device,
            self._param_prefix,
        )
        self._row_stats = RowStatExchange(self._layout, self._mp_kernels, self._pg, self.device)
        self._lr_sync = LearningRateSync(
            self._state.group_kernels,
            [opt.learning_rate for opt in self._layout.group_optimizers],
        )
        self._output = OutputAssembly(self._layout, self.tables, self.device)
        self._scratch = ScratchBuffer()  # the output exchange's temporaries, kept across steps
        # Set to a dict to accumulate forward time per phase (input_dist, lookup, output_dist).
        self.phase_seconds: dict[str, float] | None = None
        self._skip_nonfinite = skip_nonfinite
        self._timeout = timeout
        self._grad_guard = NonFiniteGradGuard(
            f"{type(self).__name__} (rank {self._rank})", " on this rank or another"
        )
        self._id_maps = self._make_id_maps(timeout)
        self._prefetched: PrefetchQueue[DistributedInput] = PrefetchQueue(
            f"{type(self).__name__} {module_path!r}"
        )

    def _build_kernels(self, timeout: datetime.timedelta) -> None:
        """This rank's kernels, and their initial weights.

        Kernels are kept out of the module tree: their weights are exposed (sharded) through
        state_dict and the fused optimizer, and must not reach DDP or a dense optimizer.
        Replicas must run the same backend on every rank: rank 0 resolves AUTO for all. The
        weights' draws do not depend on the backend (or on a cached AUTO choice).
        """
        groups = [*self._layout.mp_groups, *self._layout.dp_groups]
        with rng_unchanged(self.device):
            requests = [self._kernel_request(g) for g in groups]
            share_backend_decisions(requests, self.device, self._pg)
            self._mp_kernels = [self._make_kernel(g) for g in self._layout.mp_groups]
            self._dp_kernels = [self._make_kernel(g) for g in self._layout.dp_groups]
        self._init_weights(timeout)

    def _make_id_maps(self, timeout: datetime.timedelta) -> ShardedIdMaps | None:
        """The maps of the id-mapped tables (None: there are none)."""
        if all(t.id_map is None for t in self.tables):
            return None
        kernels = [*self._mp_kernels, *self._dp_kernels]
        return ShardedIdMaps(self.tables, self._layout, kernels, self._pg, self.device, timeout)

    def _kernel_request(self, group: GroupLayout) -> KernelRequest:
        specs = []
        for t, k in group.tables:
            table = self.tables[t]
            placement = self._layout.shardings[t].placement
            if k < 0:
                specs.append(
                    TableSpec(
                        name=table.name,
                        num_embeddings=table.num_embeddings,
                        embedding_dim=table.embedding_dim,
                        weight_dtype=table.weight_dtype,
                        placement=placement,
                    )
                )
            else:
                s = self._layout.shardings[t].shards[k]
                specs.append(
                    TableSpec(
                        name=f"{table.name}.shard{k}",
                        num_embeddings=s.num_rows,
                        embedding_dim=s.num_cols,
                        weight_dtype=table.weight_dtype,
                        placement=placement,
                    )
                )
        local = {tk: i for i, tk in enumerate(group.tables)}
        feature_table_map = [local[(vf.table, vf.shard)] for vf in group.features]
        return specs, feature_table_map, group.optimizer

    def _make_kernel(self, group: GroupLayout) -> Kernel:
        specs, feature_table_map, _ = self._kernel_request(group)
        # Shards always pool with SUM: row-shard partials add up at the source, which divides
        # mean-pooled features by the full bag length.
        return create_kernel(
            specs, feature_table_map, group.optimizer, PoolingType.SUM, self.device
        )

    def _init_weights(self, timeout: datetime.timedelta) -> None:
        groups = [*self._layout.mp_groups, *self._layout.dp_groups]
        for group, kernel in zip(groups, [*self._mp_kernels, *self._dp_kernels], strict=True):
            for (t, _), weight in zip(group.tables, kernel.split_embedding_weights(), strict=True):
                self.tables[t].init_weight(weight)  # init_fn, when given, sees each shard
        # Replicas must start equal, but each rank drew its own shards before them, so the
        # ranks' random streams differ by now: every replica takes rank 0's draw.
        src = 0 if self._pg is None else dist.get_global_rank(self._pg, 0)
        for kernel in self._dp_kernels:
            for weight in kernel.split_embedding_weights():
                sent = weight if weight.is_contiguous() else weight.contiguous()
                broadcast(sent, src, self._pg, timeout)
                if sent is not weight:
                    weight.copy_(sent)

    # ------------------------------------------------------------------------------ public
    @property
    def fused_optimizer(self) -> ShardedFusedOptimizer:
        """KeyedOptimizer over ``embedding_bags.<t>.weight`` with plan-independent state keys."""
        return self._state.optimizer

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group the collectives run on."""
        return self._pg

    def feature_names(self) -> list[str]:
        """The features looked up, in table order (repeated when shared by tables)."""
        return list(self._layout.features.feature_names)

    def kernels(self) -> list[Kernel]:
        """This rank's kernels: model-parallel ones, then data-parallel replicas."""
        return [*self._mp_kernels, *self._dp_kernels]

    @property
    def skip_nonfinite(self) -> bool:
        """Whether a NaN/inf output gradient skips the fused update on every rank."""
        return self._skip_nonfinite

    @property
    def skipped_nonfinite_steps(self) -> int:
        """Backward passes skipped (by every rank) for a NaN/inf output gradient on some rank."""
        return self._grad_guard.skipped_steps

    def _gated(self) -> bool:
        return (
            self._skip_nonfinite
            and torch.is_grad_enabled()
            and all(k.grad_hook is None for k in self.kernels())
        )

    def _admit(self, grad_mp_recv: Tensor | None, grad_dp_own: Tensor | None) -> bool:
        """Whether every rank's output gradient is finite (a collective; counts a skip)."""
        local = finite_flag([grad_mp_recv, grad_dp_own], self.device)
        return self._grad_guard.record(all_ranks_finite(local, self._pg, self._timeout))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool this rank's batch; backward updates every rank's looked-up rows in place.

        A variable batch per feature is padded to this rank's largest feature's batch with
        empty bags, distributed and looked up as a regular one, then expanded through the
        input's ``inverse_indices`` as in `EmbeddingBagCollection.forward`.

        Raises:
            InvalidIdError / ValueError: this rank's input is bad; `RemoteInputError`: another
                rank's is. Every rank raises, before anything is looked up or updated.
        """
        start = time.perf_counter()
        started = self._prefetched.take(features) or self.start_input_dist(features)
        ahead = None if self._id_maps is None else self._id_maps.take_ahead(started, self.training)
        try:
            prepared, index_F_B, received = started.wait(self._timeout)
        except ValueError:
            if self._id_maps is not None:
                self._id_maps.input_failed(self.training)
            raise
        mp_inputs = ahead if ahead is not None else self._model_parallel_inputs(received)
        start = self._record("input_dist", start)
        self._lr_sync.apply(self._state.optimizer.param_groups)
        gated = self._gated()
        if gated:  # the kernels' backward runs only if OutputExchange's admits the gradients
            mp_send, dp_global = backward_if_given(
                lambda: (
                    self._lookup_model_parallel(mp_inputs, received),
                    self._lookup_data_parallel(received),
                ),
                self._dummy,
            )
        else:
            mp_send = self._lookup_model_parallel(mp_inputs, received)
            dp_global = self._lookup_data_parallel(received)
        start = self._record("lookup", start)
        batch = prepared.stride()
        widths = self._output.dest_width
        meta = ExchangeMeta(
            group=self._pg,
            rank=self._rank,
            device=self.device,
            mp_send_splits=[b * widths[self._rank] for b in received.batch_sizes],
            mp_recv_splits=[batch * w for w in widths],
            batch_sizes=received.batch_sizes,
            dp_stride=received.max_batch,
            dp_dim=self._output.dp_dim,
            backward_hooks=[self._state.on_backward],
            admit=self._admit if gated else None,
            scratch=self._scratch,
            sum_over_ranks=self._output.sums_over_ranks,
        )
        mp_recv, dp_own = OutputExchange.apply(mp_send, dp_global, self._dummy, meta)
        pooled = self._output.assemble(mp_recv, dp_own, prepared)
        if index_F_B is not None:
            pooled = expand_rows(pooled, self._layout.features.dims, index_F_B)
        self._record("output_dist", start)
        return KeyedTensor(
            keys=self._layout.features.output_keys,
            length_per_key=self._layout.features.dims,
            values=pooled,
        )

    @property
    def id_maps(self) -> IdMaps | None:
        """This rank's id maps (None: no id-mapped table): per id-mapped table the map of its
        row shard here, or a step counter where this rank holds none; fault tolerance
        registers its observer there."""
        return None if self._id_maps is None else self._id_maps.maps

    def stats(self) -> dict[str, dict[str, float]]:
        """Per id-mapped table: occupancy, new ids, evictions, admissions of the last step,
        summed over its shards (the same on every rank)."""
        return {} if self._id_maps is None else self._id_maps.stats()

    def start_input_dist(
        self, features: KeyedJaggedTensor, ahead: bool = False
    ) -> DistributedInput:
        """Start distributing ``features`` (a collective: every rank calls it together).

        A rejected input is not raised here: `DistributedInput.wait` raises it, on every rank.
        ``ahead`` (a pipeline starts the batch before the previous batch's forward) changes
        nothing here: id-mapped tables' raw ids travel as they are (their owners map them
        after they arrive: `advance_prefetched`, or in the forward).
        """
        return start_distribution(
            features,
            self._layout.features,
            self.is_weighted,
            self._bucketizer,
            self._pg,
            self._rank,
            raw_tables=[] if self._id_maps is None else self._id_maps.names,
        )

    def advance_prefetched(self, started: DistributedInput, timeout: datetime.timedelta) -> None:
        """Start the id all-to-all of ``started`` (distributed ahead: `DistributedInput.
        advance`); in training, id maps then map its ids on the worker thread as they arrive
        (`ShardedIdMaps.start_ahead`: during the previous batch's backward)."""
        started.advance(timeout)
        if self._id_maps is not None and self.training:
            self._id_maps.start_ahead(started, self._kernel_inputs)

    def use_prefetched(self, started: DistributedInput) -> None:
        """Have the next ``forward(started.features)`` consume ``started`` instead of
        distributing its input itself (what a pipeline does with a batch distributed ahead)."""
        self._prefetched.push(started)

    def unused_prefetched(self) -> int:
        """Queued distributions no forward consumed; clears them (with id maps, the steps
        taken ahead are undone: the batch never reached its forward)."""
        count = self._prefetched.pending()
        self._prefetched.clear()
        if count:
            self.rewind_ahead()
        return count

    def rewind_ahead(self) -> None:
        """Undo the steps the id maps took ahead (none: nothing to do)."""
        if self._id_maps is not None:
            self._id_maps.maps.rewind_ahead()

    def prefetch_stale(self, started: DistributedInput) -> bool:
        """Whether ``started`` (distributed ahead) must be distributed again: never (a step
        its id maps took ahead and that was undone since is taken again in the forward, from
        the same distributed raw ids)."""
        return False

    def _record(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        if self.phase_seconds is not None:
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + now - start
        return now

    # ------------------------------------------------------------------------------ lookup
    def _model_parallel_inputs(self, received: ReceivedInput) -> list[KernelInput]:
        """The model-parallel kernels' inputs; with id maps, their raw ids mapped to rows
        (`ShardedIdMaps.remap`: every rank, every forward without a step taken ahead)."""
        inputs = self._kernel_inputs(received)
        if self._id_maps is not None:
            inputs = self._id_maps.remap(inputs, self.training)
        return inputs

    def _kernel_inputs(self, received: ReceivedInput) -> list[KernelInput]:
        groups = self._layout.mp_groups
        if not groups:
            return []
        return kernel_inputs(
            len(self._layout.dest_features[self._rank]),
            [len(g.features) for g in groups],
            received.max_batch,
            received.mp_lengths,
            received.mp_ids,
            received.mp_weights,
            received.mp_id_counts,
        )

    def _lookup_model_parallel(self, inputs: list[KernelInput], received: ReceivedInput) -> Tensor:
        if not self._layout.mp_groups:
            if self._row_stats.enabled and torch.is_grad_enabled():
                # No shards here, but the row-statistics all-to-all of the kernels' backward
                # needs every rank: an empty output whose backward joins it (after the output
                # exchange, as on the other ranks).
                return self._row_stats.attach([self._dummy.clone()], [])[0]
            return torch.zeros(0, device=self.device)
        outs = [run_kernel(kernel, x) for kernel, x in zip(self._mp_kernels, inputs, strict=True)]
        outs = self._row_stats.attach(outs, inputs)
        return send_buffer(outs, received.batch_sizes, received.max_batch)

    def _lookup_data_parallel(self, received: ReceivedInput) -> Tensor:
        rows = received.max_batch * len(received.batch_sizes)
        if not self._dp_kernels:
            return torch.zeros(rows, 0, device=self.device)
        inputs = kernel_inputs(
            len(self._layout.dp_features),
            [len(g.features) for g in self._layout.dp_groups],
            received.max_batch,
            received.dp_lengths,
            received.dp_ids,
            received.dp_weights,
            received.dp_id_counts,
        )
        outs = [run_kernel(kernel, x) for kernel, x in zip(self._dp_kernels, inputs, strict=True)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    # ------------------------------------------------------------------------------ state
    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        for name, value in self._state.weights.items():
            destination[prefix + name] = value
        if self._id_maps is not None:
            self._id_maps.save(destination, prefix)

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        own = set(self._state.weights)
        maps = self._id_maps
        for key in state_dict:
            name = key[len(prefix) :]
            if key.startswith(prefix) and name not in own:
                if maps is None or not maps.owns(name):
                    unexpected_keys.append(key)
        if maps is not None:
            maps.load(state_dict, prefix, missing_keys)
        for name in self._state.weights:
            if prefix + name not in state_dict:
                missing_keys.append(prefix + name)
                continue
            try:
                self._state.load_weight(name, state_dict[prefix + name])
            except ValueError as e:
                error_msgs.append(str(e))
