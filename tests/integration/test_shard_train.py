"""Training over a dataset kept as WebDataset shards and a Parquet table (written by the libraries' own writers):
the demo's images packed into both, cached by byte range and row group, train like the same images in a folder.
The caches come from the run's upstream store; the trainer runs in this process (tests/trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from tests.integration.test_latents_stage import rows_by_path
from tests.integration.test_train_support import small_config
from tests.trainer import steps, trainer_for
from tuneline.schemas.latents import LatentsManifest

pytestmark = pytest.mark.slow
SHARDS = 2  # the first two thirds of the images in webdataset shards, the rest in one parquet table


def _pack(demo: Path, out: Path) -> None:
    """The demo's images and captions as `000000.tar`, `000001.tar` and `rows.parquet` (with `datasets`' layout:
    an {bytes, path} image column), and which cached row each image becomes (`names.json`: source//member)."""
    images = sorted(demo.glob("*.png"))
    cut = len(images) * 2 // 3
    shards, rows = (out / "shards", images[:cut]), images[cut:]
    shards[0].mkdir(parents=True)
    names = {}
    for i in range(SHARDS):
        with wds.TarWriter(str(shards[0] / f"{i:06d}.tar")) as sink:
            for image in shards[1][i::SHARDS]:
                sink.write({"__key__": image.stem, "png": image.read_bytes(), "txt": _caption(image)})
                names[f"0//{i:06d}.tar/{image.name}"] = image.name  # source 0's member
    cells = [{"bytes": image.read_bytes(), "path": image.name} for image in rows]
    table = pa.table({"image": cells, "caption": [_caption(image) for image in rows]})
    pq.write_table(table, out / "rows.parquet", row_group_size=8)
    names |= {f"1//{i // 8}/{i % 8}": image.name for i, image in enumerate(rows)}  # source 1's row group/row
    (out / "names.json").write_text(json.dumps(names))


def _caption(image: Path) -> str:
    return image.with_suffix(".txt").read_text()


@pytest.fixture(scope="module")
def packed(upstream_store, demo_data) -> Path:
    return upstream_store.dataset("demo-packed", lambda out: _pack(demo_data, out))


def test_shards_and_a_table_cache_the_folders_latents_and_train(tmp_path, upstream_store, demo_data, packed):
    sources = [{"path": str(packed / "shards")}, {"path": str(packed / "rows.parquet")}]
    cfg = small_config(tmp_path / "w", {"steps": 2}, dataset={"path": None, "demo": False, "sources": sources})
    ctx = upstream_store.upstream(cfg)
    folder = upstream_store.upstream(small_config(tmp_path / "f", {"steps": 2}, dataset={"path": str(demo_data)}))

    # Every image's latents, read from its shard's byte range or its table row, are the folder file's.
    mine, theirs = (c.store.latest("latents") for c in (ctx, folder))
    got, want = (rows_by_path(p, c.store.read(p, LatentsManifest)) for p, c in ((mine, ctx), (theirs, folder)))
    names = json.loads((packed / "names.json").read_text())
    assert sorted(got) == sorted(names) and sorted(names.values()) == sorted(want)
    for path, latent in got.items():
        np.testing.assert_allclose(latent, want[names[path]], rtol=1e-3, atol=1e-3, err_msg=path)

    trainer = trainer_for(cfg, ctx)
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    steps(trainer, 2)
    assert len(trainer.losses) == 2 and all(np.isfinite(trainer.losses))
    assert any(not p.detach().equal(before[n]) for n, p in trainer.params.items())
    assert sum(trainer.data.reader.counts().values()) == len(names)  # every image trains
