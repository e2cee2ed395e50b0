"""A status line for command-line tools: redrawn in place on a terminal, plain lines otherwise.

Carriage-return redraws turn into one line per update in CI logs and files, so off a
terminal only every ``plain_every``-th update (and the last) is printed, as a plain line.
Used by the DLRM example's progress bar (with `format_id_map_stats` for id-mapped tables)
and ``recopt-reshard``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO


class ProgressLine:
    """One status line on ``stream``.

    Args:
        stream: where to write (stderr by default).
        plain_every: off a terminal, print every this many updates (and any ``final`` one).

    Raises:
        ValueError: ``plain_every`` below 1.
    """

    def __init__(self, stream: TextIO | None = None, plain_every: int = 1) -> None:
        if plain_every < 1:
            raise ValueError(f"plain_every must be >= 1, got {plain_every}")
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.plain_every = plain_every
        self._updates = 0
        self._last_len = 0

    def show(self, line: str, final: bool = False) -> None:
        """Redraws the line (terminal), or prints it when due or ``final`` (elsewhere)."""
        self._updates += 1
        if self.interactive:
            pad = " " * max(0, self._last_len - len(line))
            self.stream.write("\r" + line + pad)
            self._last_len = len(line)
        elif final or self._updates % self.plain_every == 0:
            self.stream.write(line + "\n")
        else:
            return
        self.stream.flush()

    def message(self, text: str) -> None:
        """Prints a line of its own without breaking the status line."""
        self.close()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends a redrawn line (a no-op off a terminal)."""
        if self.interactive and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
            self._last_len = 0


def format_id_map_stats(stats: Mapping[str, Mapping[str, float]]) -> str:
    """A short form of id-mapped tables' stats for a status line, e.g.
    ``ids 8 tables occ 62-100% new 41/step evict 30/step``.

    Args:
        stats: table -> ``occupancy`` (fraction of rows live) and per-step ``new_ids``,
            ``evictions`` and, when any, ``admissions`` (e.g. a window's means of
            ``collection.stats()``).

    Returns:
        The line's fragment; "" when there are no tables.
    """
    if not stats:
        return ""
    occupancy = [100.0 * s.get("occupancy", 0.0) for s in stats.values()]
    low, high = min(occupancy), max(occupancy)
    span = f"{low:.0f}%" if round(low) == round(high) else f"{low:.0f}-{high:.0f}%"
    total = {k: sum(s.get(k, 0.0) for s in stats.values()) for k in ("new_ids", "evictions")}
    count = len(stats)
    text = (
        f"ids {count} table{'s' if count > 1 else ''} occ {span} "
        f"new {total['new_ids']:.0f}/step evict {total['evictions']:.0f}/step"
    )
    admissions = sum(s.get("admissions", 0.0) for s in stats.values())
    return text + (f" admit {admissions:.0f}/step" if admissions else "")
