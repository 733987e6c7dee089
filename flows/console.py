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
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for h in lg.handlers:
            if (
                isinstance(h, logging.StreamHandler)
                and not isinstance(h, APILogHandler)
                and not any(isinstance(f, QuietUserErrors) for f in h.filters)
            ):
                h.addFilter(quiet)
