"""Fixtures of the integration tests: the session's store of built upstream caches (tests/upstream_store.py)."""

from __future__ import annotations

import pytest

from tests.upstream_store import UpstreamStore


@pytest.fixture(scope="session")
def upstream_store(tmp_path_factory) -> UpstreamStore:
    return UpstreamStore(tmp_path_factory.mktemp("upstream-store"))
