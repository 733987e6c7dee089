"""Prefect flows (one per stage + the pipeline) and the `tuneline` CLI. Thin: no maths here."""
import os

# Stage cores log to the "tuneline" logger; this makes Prefect ship those records to the flow run's log.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tuneline")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import logging  # noqa: E402

# Without a level the logger inherits root's WARNING and stage progress (training loss lines) is dropped.
logging.getLogger("tuneline").setLevel(logging.INFO)
