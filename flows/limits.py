"""The training concurrency limit: a Prefect global concurrency limit, so it holds across every flow run.

A deployment-level limit would only count runs of the train deployment; the pipeline runs its train stage as
an in-process subflow, so the slot is taken inside the train stage itself, whoever started it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

TRAIN_LIMIT = "tuneline-train"
# Slots are leases the holder renews while it trains; a killed holder's slot frees itself after this long.
LEASE_SECONDS = 60.0  # the server refuses leases shorter than a minute


def ensure_train_limit(limit: int, *, update: bool) -> None:
    """Create the limit if missing; `update` also resets its size (deploy does, a run keeps the UI's value)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        if update:
            client.upsert_global_concurrency_limit_by_name(TRAIN_LIMIT, limit)
            return
        try:
            client.read_global_concurrency_limit_by_name(TRAIN_LIMIT)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=TRAIN_LIMIT, limit=limit))
            except ObjectAlreadyExists:  # another run created it meanwhile
                pass


@contextmanager
def train_slot(limit: int) -> Iterator[None]:
    """Hold one training slot for the block (waits while `limit` trainings run elsewhere).

    Only against a real server: a temporary API (tuneline.flows.server) lives and dies with this process, so its
    lease store cannot free the slot of a killed holder (the count stays in its database), and the workdir lock
    already keeps two runs of one workdir apart."""
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL

    from tuneline.flows.server import ephemeral_api_url

    if not PREFECT_API_URL.value() or PREFECT_API_URL.value() == ephemeral_api_url():
        yield
        return
    ensure_train_limit(limit, update=False)
    with concurrency(TRAIN_LIMIT, occupy=1, lease_duration=LEASE_SECONDS, strict=True):
        yield
