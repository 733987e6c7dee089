"""Stage reports as Prefect artifacts (progress, tables, markdown), visible in the UI per flow run."""

from __future__ import annotations

import logging
import re

from tuneline.stages.common.report import Reporter

log = logging.getLogger("tuneline")


def _key(key: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-") or "tuneline"


class PrefectReporter(Reporter):
    def __init__(self) -> None:
        self._progress: dict[str, object] = {}

    def progress(self, key: str, fraction: float, description: str = "") -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        pct = max(0.0, min(100.0, 100.0 * fraction))
        try:
            from tuneline.flows.console import terminal_progress

            terminal_progress().update(key, pct / 100.0, description)
        except Exception as err:  # a terminal that cannot draw must not fail a stage either
            log.debug("progress bar %s not drawn: %s", key, err)
        try:
            if key not in self._progress:
                self._progress[key] = create_progress_artifact(pct, key=_key(key), description=description)
            else:
                update_progress_artifact(self._progress[key], pct, description=description)
        except Exception as err:  # reporting must never fail a stage
            log.debug("progress artifact %s not written: %s", key, err)

    def table(self, key: str, rows: list[dict], description: str = "") -> None:
        from prefect.artifacts import create_table_artifact

        try:
            create_table_artifact(rows, key=_key(key), description=description)
        except Exception as err:
            log.debug("table artifact %s not written: %s", key, err)

    def markdown(self, key: str, text: str, description: str = "") -> None:
        from prefect.artifacts import create_markdown_artifact

        try:
            create_markdown_artifact(text, key=_key(key), description=description)
        except Exception as err:
            log.debug("markdown artifact %s not written: %s", key, err)

    def image(self, key: str, url: str, description: str = "") -> None:
        """The UI shows an image artifact by URL: only for URLs a browser reaches (not local paths)."""
        from prefect.artifacts import create_image_artifact

        try:
            create_image_artifact(url, key=_key(key), description=description)
        except Exception as err:
            log.debug("image artifact %s not written: %s", key, err)
