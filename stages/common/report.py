"""How stage cores report progress and tables without importing Prefect.

The plain Reporter logs; flows pass a subclass that also creates Prefect artifacts.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tuneline")


class Reporter:
    def progress(self, key: str, fraction: float, description: str = "") -> None:
        log.debug("%s: %.0f%% %s", key, 100 * fraction, description)

    def table(self, key: str, rows: list[dict], description: str = "") -> None:
        log.debug("%s: table with %d rows", key, len(rows))

    def markdown(self, key: str, text: str, description: str = "") -> None:
        log.debug("%s: %s", key, description)
