"""The demo's Prefect markdown artifacts carry the grid and the loss curve as inline PNG images."""

from __future__ import annotations

import asyncio
import base64
import io
import re

import pytest
from PIL import Image

from tests.helpers import prefect_api

pytestmark = pytest.mark.slow

DATA_PNG = re.compile(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)")


async def _markdown_artifacts() -> dict[str, str]:
    """The newest markdown artifact of each key. A worker's session server keeps the artifacts of every run its
    tests made, more than one page of the server's (200): read every page, newest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import ArtifactSort

    out: dict[str, str] = {}
    offset = 0
    async with get_client() as client:
        while page := await client.read_artifacts(sort=ArtifactSort.CREATED_DESC, limit=200, offset=offset):
            for a in page:
                if a.type == "markdown" and a.key:
                    out.setdefault(a.key, a.data)
            offset += len(page)
    return out


async def _markdown_of(key: str, version: str) -> str:
    """The newest markdown artifact `key` whose description names an artifact `version` (its folder's name): other
    runs on the same server report under the same key."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    async with get_client() as client:
        arts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC
        )
    texts = [a.data for a in arts if version in (a.description or "")]
    assert texts, f"no {key} artifact of {version} among {len(arts)}"
    return texts[0]


def _images(markdown: str) -> list[Image.Image]:
    out = []
    for b64 in DATA_PNG.findall(markdown):
        raw = base64.b64decode(b64)
        assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) < 200_000
        out.append(Image.open(io.BytesIO(raw)))
    return out


def test_grid_and_loss_curve_inline_in_prefect(demo_run):
    with prefect_api():  # the demo's own temporary server's database, as `tuneline run` left it
        arts = asyncio.run(_markdown_artifacts())
    grid = [k for k in arts if "validate" in k or "grid" in k]
    loss = [k for k in arts if "loss" in k]
    assert grid and loss, f"artifact keys: {sorted(arts)}"
    for keys in (grid, loss):
        images = [img for k in keys for img in _images(arts[k])]
        assert images, f"no inline PNG in {keys}"
        assert all(img.format == "PNG" and min(img.size) >= 32 for img in images)
