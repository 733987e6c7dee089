"""What a `tuneline` command's terminal (or CI log) shows while flows run: each message once.

A user error raised in a stage flow was printed by Prefect as a traceback for the stage's flow run, again for the
pipeline's, once more in each `Finished in state Failed(...)` line, and then by the CLI: six copies among two
tracebacks. The CLI prints it once (`error: …`), so the console drops Prefect's copies of it; the records still
reach the flow run's log in the UI (the API handler is left alone). Errors that are bugs keep their traceback.
"""

from __future__ import annotations

import logging


class QuietUserErrors(logging.Filter):
    def __init__(self, user_errors: tuple[type[BaseException], ...], hidden_url: str | None) -> None:
        super().__init__()
        self.user_errors = (*user_errors, KeyboardInterrupt)
        self.names = tuple({e.__name__ for e in self.user_errors})
        # Prefect prints "View at <url>" for a flow run; the temporary server serves no UI, so the line is noise.
        self.hidden_url = hidden_url[: -len("/api")] if hidden_url and hidden_url.endswith("/api") else hidden_url

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and isinstance(exc, self.user_errors):
            return False
        msg = record.getMessage()
        if msg.startswith("Finished in state") and any(f"{n}:" in msg for n in self.names):
            return False
        if self.hidden_url and msg.startswith("View at ") and self.hidden_url in msg:
            return False
        # Prefect's exit drains its event/log queues and says so; the CLI's own last line is the one that matters.
        return not msg.startswith("Still processing items")


def quiet_console(user_errors: tuple[type[BaseException], ...], hidden_url: str | None = None) -> None:
    """Add the filter to every console handler Prefect's logging set-up attached (not to its API handler)."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import APILogHandler

    ensure_logging_setup()  # Prefect attaches its handlers lazily; the filter needs them now
    quiet = QuietUserErrors(user_errors, hidden_url)
    for lg in _loggers():
        for h in lg.handlers:
            if (
                isinstance(h, logging.StreamHandler)
                and not isinstance(h, APILogHandler)
                and not any(isinstance(f, QuietUserErrors) for f in h.filters)
            ):
                h.addFilter(quiet)


class TerminalProgress:
    """Progress bars (rich) under the log lines, only when the console is a terminal: a log file or CI output
    gets the log lines alone (a bar there is a stream of redraws). The bars share the console Prefect's log handler
    prints through, so each log line is printed above them rather than through them."""

    def __init__(self, console) -> None:
        self.console = console
        self.bars = None
        self.tasks: dict[str, int] = {}

    def update(self, key: str, fraction: float, description: str) -> None:
        if not self.console.is_terminal:
            return
        if self.bars is None:
            from rich.progress import BarColumn, Progress, TextColumn

            # Styles named outright: Prefect's console has a theme without rich's defaults (`bar.back`, …), and
            # a style it lacks fails every later print. The step lines already say the time left.
            plain = "none"
            self.bars = Progress(
                TextColumn("{task.fields[key]}", style=plain),
                BarColumn(style="bright_black", complete_style="green", finished_style="green", pulse_style="green"),
                TextColumn("{task.percentage:>3.0f}%", style=plain),
                TextColumn("{task.description}", style=plain),
                console=self.console,
                transient=True,
            )
            self.bars.start()
        if key not in self.tasks:
            self.tasks[key] = self.bars.add_task(description, total=1.0, key=key)
        self.bars.update(self.tasks[key], completed=fraction, description=description)
        if fraction >= 1.0:
            self.bars.remove_task(self.tasks.pop(key))
        if not self.tasks:
            self.stop()

    def stop(self) -> None:
        bars, self.bars = self.bars, None
        if bars is not None:
            bars.stop()


_terminal: TerminalProgress | None = None


def terminal_progress() -> TerminalProgress:
    """The bars of this process, on the console of Prefect's stderr log handler (a plain stderr console when Prefect
    attached none)."""
    global _terminal
    if _terminal is None:
        import atexit

        from prefect.logging.handlers import PrefectConsoleHandler
        from rich.console import Console

        handlers = [h for lg in _loggers() for h in lg.handlers if isinstance(h, PrefectConsoleHandler)]
        _terminal = TerminalProgress(handlers[0].console if handlers else Console(stderr=True))
        atexit.register(_terminal.stop)
    return _terminal


def _loggers() -> list[logging.Logger]:
    return [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
