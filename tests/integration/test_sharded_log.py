"""A sharded latents build logs its row counts once, as the shards made them (it once logged the parent's view,
"72 rows (0 encoded, ... 72 resumed)", then the shards' totals)."""

from __future__ import annotations

import logging
import re

from tests.integration.test_latents_stage import tiny_model_dir, write_images
from tests.integration.test_sharded_cache import build, context
from tuneline.schemas.latents import LatentsManifest


def test_a_sharded_build_logs_its_counts_once(tmp_path, caplog):
    write_images(tmp_path / "data", range(12))
    ctx = context(tmp_path, tiny_model_dir(tmp_path), "w", shards=2)
    with caplog.at_level(logging.INFO, logger="tuneline"):
        path = build(ctx, "scan", "latents")["latents"]
    m = ctx.store.read(path, LatentsManifest)
    lines = [r.getMessage() for r in caplog.records if re.match(r"latents: \d+ rows", r.getMessage())]
    assert lines == [
        f"latents: {m.count} rows by 2 shards ({m.encoded} encoded, {m.reused} copied from the previous version, "
        f"{m.resumed} resumed), {m.rejected} rejected"
    ]
    assert m.encoded == m.count > 0
