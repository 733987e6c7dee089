"""Prefect flows (one per stage + the pipeline) and the `tuneline` CLI. Thin: no maths here."""

import os

# Stage cores log to the "tuneline" logger; this makes Prefect ship those records to the flow run's log.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tuneline")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Prefect gives up starting its temporary server after 20 s; a busy machine needs longer (tuneline.flows.server).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

import sys  # noqa: E402

if not sys.stderr.isatty():
    # Library progress bars (diffusers/transformers tqdm, Hugging Face downloads) written to a log file or CI
    # output are carriage-return redraws: raw escape codes and runs of empty lines. Stage progress is logged.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import logging  # noqa: E402

# Without a level the logger inherits root's WARNING and stage progress (training loss lines) is dropped.
logging.getLogger("tuneline").setLevel(logging.INFO)
