"""recopt.progress: a status line redrawn on a terminal, a few plain lines in logs."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from checkpoint_helpers import ALL_DP, ShardedTables

from recopt.checkpoint import save
from recopt.checkpoint.cli import main
from recopt.progress import ProgressLine


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_off_a_terminal_every_nth_update_and_the_last() -> None:
    stream = io.StringIO()
    line = ProgressLine(stream, plain_every=4)
    for i in range(1, 11):
        line.show(f"item {i}/10", final=i == 10)
    line.message("done")
    assert stream.getvalue().splitlines() == ["item 4/10", "item 8/10", "item 10/10", "done"]
    assert "\r" not in stream.getvalue()


def test_redrawn_in_place_on_a_terminal() -> None:
    stream = _Terminal()
    line = ProgressLine(stream, plain_every=4)
    line.show("long line 1")
    line.show("short")
    line.close()
    assert stream.getvalue() == "\rlong line 1\rshort      \n"
    with pytest.raises(ValueError, match="plain_every must be >= 1, got 0"):
        ProgressLine(stream, plain_every=0)


def test_reshard_bar_in_a_log_is_a_few_plain_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ShardedTables(ALL_DP, 0, 1, seed=4)
    save(tmp_path / "ck", model, model.fused_optimizer, step=2)
    assert main([str(tmp_path / "ck"), str(tmp_path / "r2"), "--world-size", "2"]) == 0
    err = capsys.readouterr().err  # pytest's capture is not a terminal
    lines = [x for x in err.splitlines() if "tensors" in x]
    assert "\r" not in err
    total = int(lines[-1].split("/")[1].split()[0])
    assert lines[-1].split("]")[1].split()[0] == f"{total}/{total}"  # the last one is printed
    assert total > 10 and len(lines) <= 11 and len(lines) < total  # was one line per tensor
