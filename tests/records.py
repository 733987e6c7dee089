"""What a stage publishes, built by hand for tests (and benchmarks) that start past the stage: a scan record, a
latent cache laid out exactly as the latents stage writes it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tuneline.schemas.latents import LatentBucket, LatentsManifest
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.common.hashing import file_sha256
from tuneline.stages.common.jsonl import write_jsonl
from tuneline.stages.latents import store


def image_record(path: str, size: tuple[int, int], file: Path | None = None, **changes) -> ImageRecord:
    """The scan record of a `size` image kept whole in a bucket of its size; its hash and bytes are `file`'s."""
    w, h = size
    found = {"sha256": file_sha256(file), "size_bytes": file.stat().st_size} if file else {}
    facts = dict(path=path, width=w, height=h, bucket_width=w, bucket_height=h, crop=(0, 0, w, h), caption="")
    return ImageRecord(**(facts | {"sha256": "0", "size_bytes": 0, "mtime_ns": 0} | found | changes))


def write_latents(root: Path, data: dict[str, dict[str, np.ndarray]], block_rows: int, **facts) -> LatentsManifest:
    """A latent cache in `root` holding `data` (bucket "WxH" -> array name -> rows) in blocks of `block_rows`, its
    index (row i of bucket k is "k/iii.png") and the manifest that describes it (tiny's facts, with `facts`)."""
    index, buckets = [], []
    for key, arrays in data.items():
        n, shape = len(arrays["mean"]), arrays["mean"].shape[1:]
        out = store.create_arrays(root, key, shape, n, "float16", block_rows, tuple(arrays))
        for b in range(0, n, block_rows):
            store.write_block(out, b // block_rows, {k: v[b : b + block_rows] for k, v in arrays.items()})
        index += [{"path": f"{key}/{i:03d}.png", "bucket": key, "row": i, "key": f"k{key}{i}"} for i in range(n)]
        w, h = map(int, key.split("x"))
        buckets.append(LatentBucket(width=w, height=h, shape=shape, count=n, array=key))
    write_jsonl(root / store.INDEX, index)
    made = dict(fingerprint="t", tool_version="t", code_version="t", vae_identity="v", vae_dtype="float32")
    tiny = dict(family="tiny", vae_factor=8, latent_channels=4, scaling_factor=0.18, shift_factor=0.0, flip=False)
    return LatentsManifest(
        **(made | tiny | facts),
        dtype="float16",
        block_rows=block_rows,
        size_policy={},
        buckets=buckets,
        count=len(index),
    )
