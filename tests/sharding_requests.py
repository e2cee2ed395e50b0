"""One `ShardingRequest` per table for a sharding kind, or a mixed plan, for the sharded tests.

``kind`` is a `ShardingType` value or ``"mixed"`` (table-wise on rank 1, row-wise, column-wise
over ranks 1 and 0, data-parallel, in turn). Tables are named ``t0``, ``t1``, ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def requests_for(
    kind: str, world: int, num_tables: int, optimizer: Callable[[int], Any] = lambda i: None
) -> dict[str, Any]:
    """Table ``t{i}``'s request; ``optimizer(i)`` is its fused optimizer (None: the module's)."""
    from recopt.sharding import (
        column_wise,
        data_parallel,
        row_wise,
        table_column_wise,
        table_row_wise,
        table_wise,
    )

    makers: dict[str, Callable[[int], Any]] = {
        "table_wise": lambda i: table_wise(i % world, optimizer=optimizer(i)),
        "row_wise": lambda i: row_wise(optimizer=optimizer(i)),
        "column_wise": lambda i: column_wise(list(range(world)), optimizer=optimizer(i)),
        "table_row_wise": lambda i: table_row_wise(0, optimizer=optimizer(i)),
        "table_column_wise": lambda i: table_column_wise(0, optimizer=optimizer(i)),
        "data_parallel": lambda i: data_parallel(optimizer=optimizer(i)),
    }
    mixed = [
        lambda i: table_wise(1, optimizer=optimizer(i)),
        makers["row_wise"],
        lambda i: column_wise([1, 0], optimizer=optimizer(i)),
        makers["data_parallel"],
    ]
    if kind == "mixed":
        return {f"t{i}": mixed[i % len(mixed)](i) for i in range(num_tables)}
    return {f"t{i}": makers[kind](i) for i in range(num_tables)}
