"""Loaded at start-up by every Python process of a traced test run (tests/tracing/tuneline_trace.py puts this
folder on PYTHONPATH): installs the tracing wrappers in that process too."""

import os

if os.environ.get("TUNELINE_TEST_TRACE"):
    import tuneline_trace

    tuneline_trace.install()
