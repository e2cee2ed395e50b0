"""Which embedding table a checkpoint key belongs to, read from the key alone.

A table's weight is ``model/<module>.embedding_bags.<table>.weight`` (``embeddings.`` in an
embedding collection), its optimizer state ``.../state/<same fqn>/<table>.<state>``, and an
id-mapped table's map ``model/<module>.id_maps.<table>.<buffer>``. `recopt-reshard` and the
export group tensors by table with these.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

TABLE_FQN = re.compile(
    r"(?:^|/)(?P<fqn>(?:[^/]*\.)?(?P<kind>embedding_bags|embeddings)\.(?P<table>[^./]+)\.weight)"
)
MAP_KEY = re.compile(
    r"^model/(?:(?P<module>[^/]*)\.)?id_maps\.(?P<table>[^./]+)\.(?P<buffer>[a-z_]+)$"
)


def table_of(key: str, tables: Collection[tuple[str, str]] | None = None) -> tuple[str, str] | None:
    """(module path, table) of a table's weight or optimizer-state key, else ``None``.

    Optimizer state of a named `CombinedOptimizer` child carries the child's name in front of
    the weight's path (``optim/state/fused.sparse.ebc.embedding_bags.t0.weight/...``): with
    ``tables`` (the model's, from `model_tables`) such a key resolves to the model's table
    whose module path ends its own (the longest such), not to a table of its own.
    """
    match = TABLE_FQN.search(key)
    if match is None:
        return None
    table = match.group("table")
    suffix = f"{match.group('kind')}.{table}.weight"
    module = match.group("fqn")[: -len(suffix)].rstrip(".")
    if tables is None or (module, table) in tables:
        return module, table
    owners = [
        m for m, t in tables if t == table and (not m or module == m or module.endswith(f".{m}"))
    ]
    return (max(owners, key=len), table) if owners else (module, table)


def model_tables(keys: Iterable[str]) -> set[tuple[str, str]]:
    """(module path, table) of every embedding table whose weight is among ``keys``."""
    return {t for k in keys if k.startswith("model/") and (t := table_of(k)) is not None}
