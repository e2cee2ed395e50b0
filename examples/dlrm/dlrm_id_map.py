"""The DLRM script's id-mapped tables: what their maps did.

`IdMapWindow` sums each table's ``stats()`` over a logging window for the metrics log and
progress line.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from recopt.progress import format_id_map_stats

# Counters of `RemapStats` reported as means per step over a window (occupancy: the latest).
PER_STEP = ("new_ids", "evictions", "expired", "admissions", "zero_row_ids")


def _stats_source(model: nn.Module) -> Any:
    """The module whose ``stats()`` reports the maps (the model-parallel wrapper's own model
    holds the sharded collection), or None without id-mapped tables."""
    plain = getattr(model, "plain_module", model)
    bags = getattr(plain, "embedding_bags", None)
    return bags if callable(getattr(bags, "stats", None)) else None


class IdMapWindow:
    """Per table, the map's counters summed over the steps of one logging window.

    Args:
        model: the script's model (plain or model-parallel).
    """

    def __init__(self, model: nn.Module) -> None:
        self._source = _stats_source(model)
        self._sums: dict[str, dict[str, float]] = {}
        self._latest: dict[str, dict[str, float]] = {}
        self._steps = 0
        self._last_step: float | None = None

    def after_step(self) -> None:
        """Adds the last training batch's stats (a map that did not step is not counted)."""
        stats = self._source.stats() if self._source is not None else {}
        if not stats:
            return
        step = max(s["step"] for s in stats.values())
        if step == self._last_step:
            return
        self._last_step = step
        self._steps += 1
        self._latest = stats
        for table, values in stats.items():
            sums = self._sums.setdefault(table, dict.fromkeys(PER_STEP, 0.0))
            for name in PER_STEP:
                sums[name] += values.get(name, 0.0)

    def means(self) -> dict[str, dict[str, float]]:
        """Per table: ``occupancy`` (after the window's last step) and per-step means."""
        steps = max(self._steps, 1)
        return {
            table: {
                "occupancy": self._latest[table]["occupancy"],
                **{name: total / steps for name, total in sums.items()},
            }
            for table, sums in self._sums.items()
        }

    def take(self) -> tuple[dict[str, float], str]:
        """The window's metrics-log values (``id_map.<table>.<stat>``) and the progress
        line's short form; then starts a new window."""
        means = self.means()
        record = {
            f"id_map.{table}.{name}": value
            for table, values in means.items()
            for name, value in values.items()
        }
        self._sums, self._steps = {}, 0
        return record, format_id_map_stats(means)
