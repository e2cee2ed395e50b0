"""Host copies of the per-table ``step`` counters, so a training step never reads them back.

A stepped optimizer's counters are 0-dim int64 tensors in each table's state (checkpointed,
loaded in place). On a GPU, reading one is a device sync; the mirror reads them only after
something outside the optimizer wrote them (the tensor's version counter moved, as a
checkpoint load does), then all tables in one read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


class StepMirror:
    """The step counters of a kernel's tables, mirrored on the host.

    Args:
        steps: the counters as they are now.
        initial: their values, when known without reading them (freshly zeroed state);
            ``None`` reads them at the first use.
    """

    def __init__(self, steps: Sequence[Tensor], initial: Sequence[int] | None = None) -> None:
        self._values: list[int] = [] if initial is None else list(initial)
        # (identity, version) of each counter when the mirror last agreed with it.
        self._seen: list[tuple[int, int]] = [] if initial is None else self._marks(steps)

    @staticmethod
    def _marks(steps: Sequence[Tensor]) -> list[tuple[int, int]]:
        return [(id(t), t._version) for t in steps]

    def values(self, steps: Sequence[Tensor]) -> list[int]:
        """The counters' current values; reads them (one read for all) only when stale."""
        marks = self._marks(steps)
        if marks != self._seen or len(self._values) != len(steps):
            self._values = [int(v) for v in torch.stack(list(steps)).tolist()]
            self._seen = marks
        return list(self._values)

    def advance(self, steps: Sequence[Tensor]) -> list[int]:
        """Add one to every counter (on its device, no read) and return the new values."""
        values = [v + 1 for v in self.values(steps)]
        with torch.no_grad():
            for step in steps:
                step.add_(1)
        self._values = values
        self._seen = self._marks(steps)
        return list(values)
