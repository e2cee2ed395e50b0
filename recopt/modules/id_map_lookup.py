"""The id maps of a collection: a batch's raw ids remapped to rows before the lookup.

`IdMaps` holds one `IdMap` per id-mapped table (its buffers are in the collection's
state_dict under ``id_maps.<table>.``). `IdMaps.remap` rewrites the mapped features' ids to
rows and drops the ids that read the zero row (not admitted yet); a mean-pooled bag keeps its
full id count as divisor (`mean_scale`). The rows given to new ids are then reset by the
collection (`recopt.modules.id_map_rows`). A `RemapObserver` (fault tolerance's guard) is told
of every map step, with its undo record, and of every fresh row before it is reset, so that a
dropped step can put the map and the rows back. With ``IdMaps.peers`` set (fault tolerance's
replica sync), a training step gathers the peers' raw ids and steps the maps with all of them
(`step_with_peers`), so every peer's maps stay equal. A pipeline remaps a batch ahead of its
forward (`start_ahead`; the step stays pending in ``IdMaps.ahead`` until then).
Legend: F features, B batch size, M ids.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from recopt.modules.config import BaseEmbeddingConfig
from recopt.modules.id_map import IdMap, Remapped, map_device
from recopt.modules.id_map_ahead import AheadRemap, AheadSteps
from recopt.modules.id_map_batch import MappedBatch, apply_rows, rows_buffer, table_ids
from recopt.modules.id_map_native import remap_tables
from recopt.modules.id_map_results import results_to
from recopt.modules.id_map_rows import ResetPlan, ResetTargets, fresh_resets, fresh_values
from recopt.modules.inputs import (
    FeatureLayout,
    PendingCheck,
)
from recopt.modules.variable_batch import regular_batch
from recopt.sparse import KeyedJaggedTensor


class RemapObserver(Protocol):
    """Told what a training step does to the maps and rows (`FusedEmbeddingGuard`)."""

    def map_stepped(self, table: str, idmap: IdMap, result: Remapped) -> None:
        """``idmap`` (table ``table``) took a training step; ``result.undo`` reverts it.

        Called before any of the step's fresh rows is reset.
        """

    def before_reset(
        self,
        table: str,
        weight: torch.Tensor,
        states: Mapping[str, torch.Tensor],
        rows: torch.Tensor,
    ) -> None:
        """``rows`` of ``weight`` (a table or a shard of it; ``states`` its optimizer state)
        are about to be re-initialised for new ids."""


class PeerIds(Protocol):
    """Gathers a training batch's raw ids from the peers whose maps must stay equal to these."""

    def gather(
        self, ids: Mapping[str, torch.Tensor], bad: bool
    ) -> tuple[list[dict[str, torch.Tensor]], int] | None:
        """Every peer's ids by table (``ids`` here), in peer order, and this peer's index.

        ``bad``: this peer's input failed its check (it raises after the exchange). Returns
        None when the step will be dropped (a peer's input was bad, or the exchange failed):
        the maps are then stepped with the local ids, and the step's rollback undoes that.
        """


class IdMaps(nn.ModuleDict):
    """The maps of a collection's id-mapped tables, by table name (``id_maps.<table>.``).

    ``observers`` (`RemapObserver`) are told of every training step of a map, which then
    records its undo record, and of every fresh row before `reset_fresh_tables` resets it.

    Args:
        tables: the collection's tables (those without ``id_map`` are left alone).
        device: the tables' device; the maps live there, or in host memory for CUDA tables
            (`map_device`: their remap then runs natively on the host).
    """

    def __init__(
        self, tables: Sequence[BaseEmbeddingConfig], device: torch.device | str | None
    ) -> None:
        home = map_device(device)
        super().__init__(
            {
                t.name: IdMap(t.id_map, t.num_embeddings, home)
                for t in tables
                if t.id_map is not None
            }
        )
        self.home = home
        self.on_host = home != torch.device("cpu" if device is None else device)
        for idmap in self.values():
            assert isinstance(idmap, IdMap)
            idmap.on_host = self.on_host
        self.observers: list[RemapObserver] = []
        self.peers: PeerIds | None = None
        self.ahead = AheadSteps()
        self._register_state_dict_hook(_committed_maps)
        self._register_load_state_dict_pre_hook(self._rewind_before_load)

    def __getstate__(self) -> dict[str, object]:
        """A copy or pickle (``copy.deepcopy``, ``torch.save`` of the module) is unobserved
        and unsynced: the observers and peers (a guard, a manager) belong to this instance.
        The pending ahead steps are undone first (their fresh rows are not reset yet: a copy
        with them would be no state the plain loop reaches); the pipeline remaps their
        batches again."""
        self.rewind_ahead()
        state = dict(self.__dict__)
        state["observers"] = []
        state["peers"] = None
        state["ahead"] = AheadSteps()
        state.pop("_maps", None)  # (`maps`' cache: made again)
        return state

    def _rewind_before_load(self, *args: object) -> None:
        """Before a load (load_state_dict pre-hook): the pending ahead steps are undone (a
        load may leave some maps out: those stay as the plain loop has them)."""
        self.rewind_ahead()

    def add_observer(self, observer: RemapObserver) -> None:
        """Show ``observer`` every training step from now on (fault tolerance's guard). The
        pending ahead steps are undone first: they were recorded for no observer, so their
        batches are remapped again in their forwards, observed."""
        self.rewind_ahead()
        self.observers.append(observer)

    def sync_with(self, peers: PeerIds | None) -> None:
        """Step the maps with every peer's ids from now on (None: alone again); as
        `add_observer`, the pending ahead steps are undone first."""
        self.rewind_ahead()
        self.peers = peers

    def can_step_ahead(self) -> bool:
        """Whether a pipeline may remap batches ahead (`start_ahead`): not under fault
        tolerance (its observers and peers step the maps inline, with its own undo)."""
        return not self.observers and self.peers is None

    @staticmethod
    def of(
        tables: Sequence[BaseEmbeddingConfig], device: torch.device | str | None
    ) -> IdMaps | None:
        """The maps of ``tables``, or None when no table is id-mapped."""
        if all(t.id_map is None for t in tables):
            return None
        return IdMaps(tables, device)

    def put(self, name: str, idmap: IdMap) -> None:
        """Add table ``name``'s map, built on ``home`` (a shard's, in a sharded collection)."""
        idmap.on_host = self.on_host
        self[name] = idmap

    def table_map(self, name: str) -> IdMap:
        """The map of table ``name``."""
        idmap = self[name]
        assert isinstance(idmap, IdMap)
        return idmap

    def maps(self) -> dict[str, IdMap]:
        """Every map by table name, in order (made again only when the maps changed: a
        pipeline asks every step)."""
        modules = tuple(self._modules.values())
        cached = self.__dict__.get("_maps")
        if cached is None or cached[0] != modules:
            maps = {name: self.table_map(name) for name in self}
            self.__dict__["_maps"] = cached = modules, maps
        return dict(cached[1])

    def stats(self) -> dict[str, dict[str, float]]:
        """Per table: the last training batch's occupancy, new ids, evictions, admissions
        (of the last batch that reached its forward: ahead steps are not counted yet)."""
        maps = self.maps()
        return {name: stats.as_dict() for name, stats in self.ahead.stats_before(maps).items()}

    def remap(
        self, features: KeyedJaggedTensor, layout: FeatureLayout, training: bool
    ) -> MappedBatch:
        """Rows for the id-mapped features of ``features`` (selected in ``layout``'s order).

        Every feature of a table shares its map: their ids are remapped together, as one step
        of the map. Ids that read the zero row are dropped from their bags. With ``peers``, a
        training step steps the maps with every peer's ids (`step_with_peers`).
        """
        names = list(self)
        one_call = training and not self.observers and self.peers is None  # (`step_many`)
        into = rows_buffer(features, layout, names) if one_call else None
        results = self.remap_ids(table_ids(features, layout, names), training, into)
        return apply_rows(features, layout, results, into)

    def remap_ids(
        self,
        ids: Mapping[str, torch.Tensor],
        training: bool,
        rows_into: torch.Tensor | None = None,
    ) -> dict[str, Remapped]:
        """Rows for each table's raw ids (``ids``: table -> its features' ids, concatenated).

        In training each map takes one step (with ``peers``: with every peer's ids; with
        observers: through `step`, undo records included); otherwise the maps are only read.
        Steps taken ahead by a pipeline (`start_ahead`) are undone first: this batch comes
        before them (they go stale and their batches are remapped again). ``rows_into``: as
        `remap_tables`' (used by the native maps' one call only).
        """
        self.rewind_ahead()
        if training and self.peers is not None:
            gathered = self.peers.gather(ids, False)
            if gathered is not None:
                return step_with_peers(self, *gathered)
        if training:
            return self.step_many(ids, rows_into=rows_into)
        return remap_tables({name: self.table_map(name) for name in ids}, ids, False)

    def step_many(
        self,
        ids: Mapping[str, torch.Tensor],
        record_undo: bool = False,
        rows_into: torch.Tensor | None = None,
    ) -> dict[str, Remapped]:
        """One training step of each map of ``ids`` (table -> raw ids): per table through
        `step` while observers watch (a guarded step, with undo records), else the native
        maps in one call (`remap_tables`, ``rows_into`` as there). ``record_undo``: each
        result carries its undo record in any case."""
        if self.observers:
            return {name: self.step(name, ids[name], record_undo) for name in ids}
        maps = {name: self.table_map(name) for name in ids}
        return remap_tables(maps, ids, True, record_undo, rows_into=rows_into)

    def step(self, name: str, ids_M: torch.Tensor, record_undo: bool = False) -> Remapped:
        """A training `IdMap.remap` of table ``name``, shown to the observers (with its undo
        record) when there are any; ``record_undo``: with its undo record in any case."""
        idmap = self.table_map(name)
        if not (self.observers or record_undo):
            return idmap.remap(ids_M, True)
        result = idmap.remap(ids_M, True, record_undo=True)
        for observer in self.observers:
            observer.map_stepped(name, idmap, result)
        return result

    def rewind_ahead(self) -> None:
        """Undo the pending ahead steps (`AheadSteps.rewind`); nothing pending: nothing to do
        (the inline remap's hot path pays one length check)."""
        if len(self.ahead):
            self.ahead.rewind(self.maps())

    def before_reset(
        self,
        name: str,
        weight: torch.Tensor,
        states: Mapping[str, torch.Tensor],
        rows: torch.Tensor,
    ) -> None:
        """Tell the observers that ``rows`` of table ``name``'s ``weight`` will be reset."""
        for observer in self.observers:
            observer.before_reset(name, weight, states, rows)


def rewind_ahead_steps(model: nn.Module) -> None:
    """Undo the pending ahead steps of every id-mapped collection in ``model`` (a fused
    collection's maps, a sharded one's shard maps): its maps' buffers are then the live state
    that `state_dict` writes, not copies of it (a checkpoint load backs them up first)."""
    for module in model.modules():
        maps = getattr(module, "id_maps", None)
        if isinstance(maps, IdMaps):
            maps.rewind_ahead()


def _committed_maps(
    module: nn.Module, state: dict[str, object], prefix: str, metadata: object
) -> None:
    """state_dict hook of `IdMaps`: the maps as before their pending ahead steps."""
    assert isinstance(module, IdMaps)
    module.ahead.committed_state(state, prefix)


def step_with_peers(
    maps: IdMaps, per_peer: Sequence[Mapping[str, torch.Tensor]], index: int
) -> dict[str, Remapped]:
    """Step every map once with all peers' ids (concatenated in peer order); keep peer
    ``index``'s rows.

    A map step depends only on the ids and their order, so every peer stepping with the same
    global batch keeps the same map. The fresh rows are the global step's (every peer resets
    them, with the hashed init the same values everywhere).
    """
    results = {}
    for name in maps:
        parts = [p[name] for p in per_peer]
        result = maps.step(name, torch.cat(parts))
        start = sum(p.numel() for p in parts[:index])
        rows = result.rows_M[start : start + parts[index].numel()]
        results[name] = Remapped(rows, result.fresh_rows, result.fresh_ids, result.stats)
    return results


def prepare_mapped(
    id_maps: IdMaps,
    layout: FeatureLayout,
    features: KeyedJaggedTensor,
    is_weighted: bool,
    weight_dtype: torch.dtype,
    training: bool,
) -> MappedBatch:
    """`FeatureLayout.prepare` for a collection with id-mapped tables, then the remap.

    The unmapped features' ids and every weight are checked first, so a bad input raises
    before any map changes; the mapped features' raw ids need no check (any int64 is valid).
    The caller re-initialises ``fresh`` rows before its lookup.

    Raises:
        As `FeatureLayout.prepare`.
    """
    peers = id_maps.peers if training else None
    try:
        features = layout.select(features, is_weighted, weight_dtype)
    except ValueError:
        if peers is not None:
            peers.gather({}, True)  # the peers' exchange waits for this one
        raise
    check = unmapped_check(features, layout, list(id_maps))
    if peers is not None and check.bad is not None and bool(check.bad):
        peers.gather({}, True)
    check.raise_if_bad()
    return id_maps.remap(features, layout, training)


def start_ahead(
    id_maps: IdMaps,
    layout: FeatureLayout,
    features: KeyedJaggedTensor,
    is_weighted: bool,
    weight_dtype: torch.dtype,
    threads: int | None = 1,
    fresh_tables: Mapping[str, BaseEmbeddingConfig] | None = None,
    host_features: KeyedJaggedTensor | None = None,
    reset_targets: ResetTargets | None = None,
) -> AheadRemap:
    """`prepare_mapped` of a training batch, started ahead of its forward (pipelined training).

    The input is checked first: a rejected one keeps its error in the result (raised at the
    batch's forward, by `AheadSteps.take`) and moves no map. Then every map takes the batch's
    step with its undo record (`id_maps.ahead` keeps it pending until the forward takes it).
    With native maps all of it runs on the worker thread (``threads`` for the native call;
    None: torch's), the checks included (the training step's thread only hands it over);
    other maps step now. The caller resets the fresh rows when the forward takes it; the
    initial weights of those of ``fresh_tables`` (uniform init, float32 weights) are made on
    the worker too (`fresh_values`), so that reset only copies them.

    ``host_features``: the same batch still in host memory (a pipeline copying it to a GPU),
    for maps kept on the host: their ids are read, checked and remapped there, and the rows
    go to the device behind its work, so the worker never waits for the GPU.

    ``reset_targets``: the tables' weights and states (`ResetTargets`); the worker then also
    works out the fresh rows' reset (``remap.reset_plan``), which the forward only runs.
    """
    ahead = id_maps.ahead
    remap = AheadRemap(features, ahead.generation)
    maps = id_maps.maps()
    on_host = host_features is not None and all(m.on_host for m in maps.values())
    background = all(idmap._native() is not None for idmap in maps.values())

    def step() -> None:  # on the worker: the batch's checks too, off the training step
        start = time.perf_counter()
        try:
            regular, remap.index_F_B = regular_batch(features, layout.feature_names)
            selected = layout.select(regular, is_weighted, weight_dtype)
            source = selected
            if on_host:
                assert host_features is not None
                host_regular, _ = regular_batch(host_features, layout.feature_names)
                source = layout.select(host_regular, is_weighted, weight_dtype)
            unmapped_check(source, layout, list(maps)).raise_if_bad()
        except ValueError as e:
            remap.error = e  # raised at the batch's forward; no map moved
            return
        ids = table_ids(source, layout, list(maps))
        device = selected.values().device
        into = rows_buffer(source, layout, list(maps)) if device.type == "cpu" else None
        results = remap_tables(maps, ids, True, record_undo=True, threads=threads, rows_into=into)
        remap.undo = {name: result.undo for name, result in results.items() if result.undo}
        if fresh_tables:
            fill_start = time.perf_counter()
            fresh_values(results, fresh_tables, threads or torch.get_num_threads())
            remap.fill_s = time.perf_counter() - fill_start
        remap.mapped = apply_rows(selected, layout, results_to(results, device), into)
        if reset_targets is not None:
            fresh = fresh_resets(reset_targets, remap.mapped.fresh)
            remap.reset_plan = ResetPlan(fresh, reset_targets)
        remap.busy_s = time.perf_counter() - start - (remap.fill_s or 0.0)

    return ahead.submit(remap, step, background)


def unmapped_check(
    features: KeyedJaggedTensor, layout: FeatureLayout, mapped: Sequence[str]
) -> PendingCheck:
    """The id check of the features of tables not in ``mapped`` and of every weight (the
    mapped features' raw ids are all valid), its answer left on the device."""
    return layout.pending_check(features, clamp=False, raw_tables=mapped)


def refuse_init_fn(tables: Sequence[BaseEmbeddingConfig], copies: str, fix: str) -> None:
    """Id-mapped tables with ``init_fn`` cannot have copies that must stay equal.

    Fresh rows of such copies (``copies``: "on every rank", "in every replica group") are
    re-initialised from a hash of the id, which an ``init_fn`` cannot give.

    Raises:
        ValueError: naming the tables and, with ``fix``, what to do instead.
    """
    names = [t.name for t in tables if t.id_map is not None and t.init_fn is not None]
    if names:
        raise ValueError(
            f"tables {names} have id_map and init_fn; their fresh rows are re-initialised "
            f"from a hash of the id (the same {copies}), which an init_fn cannot give: drop "
            f"init_fn (use weight_init_min / weight_init_max) or {fix}"
        )
