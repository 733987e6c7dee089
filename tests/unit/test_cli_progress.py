"""Progress bars under the log lines on a terminal, none in a log file or CI output."""

from __future__ import annotations

from io import StringIO

from rich.console import Console
from rich.theme import Theme

from tuneline.flows.console import TerminalProgress


def test_bars_draw_on_a_terminal_and_go_when_done():
    # the console Prefect's log handler prints through: a theme without rich's default styles
    term = Console(file=StringIO(), force_terminal=True, width=120, theme=Theme(inherit=False))
    bars = TerminalProgress(term)
    bars.update("train-progress", 0.5, "step 500/1000")
    assert bars.bars is not None
    bars.bars.refresh()
    term.print("a log line")  # printed above the bar, through the same console
    out = term.file.getvalue()
    assert "train-progress" in out and "step 500/1000" in out and "50%" in out and "a log line" in out
    bars.update("train-progress", 1.0, "step 1000/1000")
    assert bars.bars is None and not bars.tasks


def test_no_bars_in_a_log_file():
    plain = Console(file=StringIO(), force_terminal=False)
    bars = TerminalProgress(plain)
    bars.update("train-progress", 0.5, "step 500/1000")
    assert bars.bars is None and plain.file.getvalue() == ""
