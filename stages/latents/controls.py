"""Control latents of a paired dataset (dataset.control), cached beside the targets: `controls/<bucket>.npy`, one
(C, h, w) row per target row (the VAE's mean: FLUX.1 Kontext encodes its input with sample_mode "argmax"), and
`controls/<bucket>.flip.npy` with latents.flip. Each control is resized to its image's size and then gets the
image's crop and bucket, so the pair lines up token for token.

Incremental: a row's key hashes the control's content hash, the image's size, crop and bucket, and the VAE and
dtype identity; rows of the previous version with the same key are copied, not encoded again.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.common.artifacts import ArtifactError, safe_join
from tuneline.stages.common.hashing import digest, file_sha256
from tuneline.stages.common.stage import reusable_previous
from tuneline.stages.latents.encode import check_latents, to_pixels
from tuneline.stages.latents.store import bucket_key
from tuneline.stages.scan.images import load_rgb

FOLDER = "controls"


def control_file(artifact_dir: Path, bucket: str, flipped: bool = False) -> Path:
    return Path(artifact_dir) / FOLDER / f"{bucket}{'.flip' if flipped else ''}.npy"


def _keys_file(artifact_dir: Path, bucket: str) -> Path:
    return Path(artifact_dir) / FOLDER / f"{bucket}.keys.json"


def row_key(rec: ImageRecord, identity: dict) -> str:
    size = [rec.width, rec.height, rec.bucket_width, rec.bucket_height, *rec.crop]
    return digest({"control": rec.control_sha256, "size": size, **identity}, length=32)


def pixels(rec: ImageRecord, root: Path) -> torch.Tensor:
    """The control as the target's pixels: resized to the image's size, then the image's crop and bucket."""
    path = safe_join(root, rec.control_path)
    if file_sha256(path) != rec.control_sha256:
        raise ArtifactError(
            f"control image {path} of {rec.path} changed since the scan (content hash differs): run "
            f"`tuneline stage scan` again"
        )
    img = load_rgb(path)
    if img.size != (rec.control_width, rec.control_height):
        raise ArtifactError(f"control image {path} is {img.size}, the scan recorded it otherwise: rescan")
    return to_pixels(img.resize((rec.width, rec.height), Image.Resampling.BICUBIC), rec)


class _Previous:
    """Rows of the previous published version's control arrays, by key."""

    def __init__(self, ctx, flip: bool):
        found = reusable_previous(ctx, "latents", LatentsManifest)
        self.where: dict[str, tuple[Path, str, int]] = {}
        if found is None or not found[1].controls or found[1].flip != flip:
            return
        for keys in (found[0] / FOLDER).glob("*.keys.json"):
            bucket = keys.name.removesuffix(".keys.json")
            for i, k in enumerate(json.loads(keys.read_text())):
                self.where[k] = (found[0], bucket, i)

    def get(self, key: str, flipped: bool) -> np.ndarray | None:
        at = self.where.get(key)
        return None if at is None else _array(str(at[0]), at[1], flipped)[at[2]]


def write_controls(
    ctx,
    work: Path,
    index: list[dict],
    records: list[ImageRecord],
    control_root: Path | None,
    encoder,
    shape_of: dict[str, tuple[int, int, int]],
    identity: dict,
) -> dict:
    """Every bucket's control latents when the records have controls; returns the manifest's counts."""
    sized = {(r.ref, bucket_key(r.bucket_width, r.bucket_height)): r for r in records}
    if control_root is None or not any(sized[row["path"], row["bucket"]].control_path for row in index):
        return {"controls": 0}
    buckets: dict[str, list[dict]] = {}
    for row in index:
        buckets.setdefault(row["bucket"], []).append(row)
    flip, dtype = ctx.cfg.latents.flip, np.dtype(ctx.cfg.latents.dtype)
    previous, encoded, reused = _Previous(ctx, flip), 0, 0
    (work / FOLDER).mkdir(exist_ok=True)
    for bucket, members in buckets.items():
        members.sort(key=lambda row: row["row"])
        recs = [sized[row["path"], bucket] for row in members]
        keys = [row_key(r, identity) for r in recs]
        out = {False: np.zeros((len(recs), *shape_of[bucket]), dtype)}
        if flip:
            out[True] = np.zeros_like(out[False])
        todo = []
        for i, key in enumerate(keys):
            if key in previous.where:
                for flipped in out:
                    out[flipped][i] = previous.get(key, flipped)
                reused += 1
            else:
                todo.append(i)
        for start in range(0, len(todo), ctx.cfg.latents.batch_size):
            part = todo[start : start + ctx.cfg.latents.batch_size]
            got = encoder([pixels(recs[i], control_root) for i in part], [recs[i].path for i in part], shape_of[bucket])
            for j, i in enumerate(part):
                out[False][i] = got["mean"][j]
                if flip:
                    out[True][i] = got["flip_mean"][j]
            encoded += len(part)
        check_latents({"mean": out[False]}, shape_of[bucket], [r.path for r in recs])
        for flipped, arr in out.items():
            np.save(control_file(work, bucket, flipped), arr)
        _keys_file(work, bucket).write_text(json.dumps(keys))
    ctx.log.info("latents: control latents of %d rows (%d encoded, %d copied)", len(index), encoded, reused)
    return {"controls": len(index), "controls_encoded": encoded, "controls_reused": reused}


@lru_cache(maxsize=64)
def _array(artifact_dir: str, bucket: str, flipped: bool) -> np.ndarray:
    return np.load(control_file(Path(artifact_dir), bucket, flipped), mmap_mode="r")


def read(reader, batch) -> torch.Tensor | None:
    """(B, C, h, w) float32 control latents of a reader batch (the flipped control for flipped rows); None when the
    cache holds none. Checked against the bucket's latent shape, as the targets are."""
    if not getattr(reader.manifest, "controls", 0):
        return None
    flips = batch.flip or (False,) * len(batch.rows)
    rows = [np.asarray(_array(str(reader.dir), batch.bucket, f)[r], np.float32) for r, f in zip(batch.rows, flips)]
    out = torch.from_numpy(np.stack(rows))
    expected = tuple(reader.shapes[batch.bucket])
    if tuple(out.shape[1:]) != expected:
        raise ArtifactError(
            f"control latents of bucket {batch.bucket} in {reader.dir} are {tuple(out.shape[1:])}, the targets "
            f"{expected}: rebuild with `tuneline stage latents --force`"
        )
    return out
