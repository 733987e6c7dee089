"""Control latents of a paired dataset (dataset.control), cached beside the targets: `controls/<bucket>.npy`, one
(C, h, w) row per target row (the VAE's mean: FLUX.1 Kontext encodes its input with sample_mode "argmax"), and
`controls/<bucket>.flip.npy` with latents.flip. Each control is resized to its image's size and then gets the
image's crop and bucket, so the pair lines up token for token; a family whose pipeline encodes its input at a size of
its own (Qwen-Image-Edit: about 1 MP whatever the output size) names it with `control_size(width, height)`, and the
aligned control is resized to that instead of the bucket: the manifest's `control_shapes` records each bucket's
control latent shape, which the reader checks. An image with N reference images (a family that
takes several, FLUX.2: `<control>/<stem>/*.png`) has an (N, C, h, w) row, its references in name order; every image
of the dataset has the same N (the scan checks it).

Incremental: a control's key hashes its content hash, the image's size, crop, bucket and control size, and the VAE and
dtype identity; controls (each reference apart) of the previous version with the same key are copied, not encoded
again.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ImageRecord, Location
from tuneline.stages.common.artifacts import ArtifactError, safe_join
from tuneline.stages.common.hashing import digest, file_sha256
from tuneline.stages.common.stage import reusable_previous
from tuneline.stages.families import resolve as models
from tuneline.stages.latents.encode import check_latents, to_pixels
from tuneline.stages.latents.store import bucket_key, open_npy
from tuneline.stages.scan.images import load_rgb
from tuneline.stages.scan.members import control_bytes

FOLDER = "controls"


def control_file(artifact_dir: Path, bucket: str, flipped: bool = False) -> Path:
    return Path(artifact_dir) / FOLDER / f"{bucket}{'.flip' if flipped else ''}.npy"


def _keys_file(artifact_dir: Path, bucket: str) -> Path:
    return Path(artifact_dir) / FOLDER / f"{bucket}.keys.json"


def row_key(rec: ImageRecord, identity: dict, sha256: str | None = None, size: tuple[int, int] | None = None) -> str:
    """The cache key of one control (of reference `sha256` among several) at its image's size, crop and bucket,
    encoded at `size` (width, height) when that is not the bucket's."""
    sizes = [rec.width, rec.height, rec.bucket_width, rec.bucket_height, *rec.crop]
    if size is not None and tuple(size) != (rec.bucket_width, rec.bucket_height):
        sizes += list(size)  # absent at the bucket's size: keys of caches made before control_size stay valid
    return digest({"control": sha256 or rec.control_sha256, "size": sizes, **identity}, length=32)


def control_size(fam, width: int, height: int, area: int | None = None) -> tuple[int, int]:
    """The pixel size a control of a (width, height) bucket is encoded at: the family's control_size (for the
    run's input area: resolve.input_area), or the bucket's."""
    return tuple(fam.control_size(width, height, area))


def control_shape(fam, width: int, height: int, area: int | None = None) -> tuple[int, int, int]:
    """The (C, h, w) latents of a control of a (width, height) bucket, encoded at control_size."""
    w, h = control_size(fam, width, height, area)
    f = fam.facts.vae_factor
    return (fam.facts.latent_channels, h // f, w // f)


def references(rec: ImageRecord) -> list[tuple[str, str, int, int]]:
    """(path, sha256, width, height) of each of the record's controls: one, or several in order."""
    if rec.control_references is None:
        return [(rec.control_path, rec.control_sha256, rec.control_width, rec.control_height)]
    return [(f.path, f.sha256, f.width, f.height) for f in rec.control_references]


def pixels(rec: ImageRecord, root: Path | Location, ref: int = 0, size: tuple[int, int] | None = None) -> torch.Tensor:
    """Control `ref` as the target's pixels: resized to the image's size, then the image's crop and bucket (or
    `size`). `root`: the control folder, or for a sample's control member the image's source."""
    rel, sha, width, height = references(rec)[ref]
    if rec.control_offset is not None:  # the sample's control member, by its byte range in the image's shard
        try:
            img, path = load_rgb(io.BytesIO(control_bytes(root, rec))), rec.control_path
        except ValueError as err:
            raise ArtifactError(str(err)) from None
    else:
        path = safe_join(root, rel)
        if file_sha256(path) != sha:
            raise ArtifactError(
                f"control image {path} of {rec.path} changed since the scan (content hash differs): run "
                f"`tuneline run --until latents` (it rescans, then caches the new control)"
            )
        img = load_rgb(path)
    if img.size != (width, height):
        raise ArtifactError(f"control image {path} is {img.size}, the scan recorded it otherwise: rescan")
    return to_pixels(img.resize((rec.width, rec.height), Image.Resampling.BICUBIC), rec, size)


class _Previous:
    """Rows of the previous published version's control arrays, by key (one key per reference)."""

    def __init__(self, ctx, flip: bool):
        found = reusable_previous(ctx, "latents", LatentsManifest)
        self.where: dict[str, tuple[Path, str, int, int | None]] = {}
        if found is None or not found[1].controls or found[1].flip != flip:
            return
        for keys in (found[0] / FOLDER).glob("*.keys.json"):
            bucket = keys.name.removesuffix(".keys.json")
            for i, k in enumerate(json.loads(keys.read_text())):
                for j, key in enumerate(k) if isinstance(k, list) else [(None, k)]:
                    self.where[key] = (found[0], bucket, i, j)

    def get(self, key: str, flipped: bool) -> np.ndarray | None:
        at = self.where.get(key)
        if at is None:
            return None
        row = _array(str(at[0]), at[1], flipped)[at[2]]
        return row if at[3] is None else row[at[3]]


def _check_family(ctx, n: int) -> None:
    """Several references per image only for a family that takes them (the scan refuses it, but a scan made
    for another family can be reused)."""
    if n > 1 and not models.family(ctx.cfg).multiple_references:
        raise ArtifactError(
            f"the scan pairs each image with {n} reference images, but family {ctx.cfg.model.family!r} takes one "
            f"control image: keep one per image (<control>/<stem>.png) and run `tuneline run --until latents`"
        )


def write_controls(
    ctx,
    work: Path,
    index: list[dict],
    records: list[ImageRecord],
    roots: dict[int | None, Path | None],
    encoder,
    shape_of: dict[str, tuple[int, int, int]],
    identity: dict,
) -> dict:
    """Every bucket's control latents when the records have controls; returns the manifest's counts. Arrays are
    (rows, C, h, w) for one control per image, (rows, N, C, h, w) for N references."""
    sized = {(r.ref, bucket_key(r.bucket_width, r.bucket_height, r.frames)): r for r in records}
    if not any(sized[row["path"], row["bucket"]].control_path for row in index):
        return {"controls": 0}
    n = max(len(references(r)) for r in records if r.control_path)
    _check_family(ctx, n)
    buckets: dict[str, list[dict]] = {}
    for row in index:
        buckets.setdefault(row["bucket"], []).append(row)
    previous, counts = _Previous(ctx, ctx.cfg.latents.flip), {"encoded": 0, "reused": 0}
    (work / FOLDER).mkdir(exist_ok=True)
    fam, shapes, area = models.family(ctx.cfg), {}, models.input_area(ctx.cfg)
    for bucket, members in buckets.items():
        members.sort(key=lambda row: row["row"])
        recs = [sized[row["path"], bucket] for row in members]
        width, height = recs[0].bucket_width, recs[0].bucket_height
        shapes[bucket] = control_shape(fam, width, height, area)
        at = _Bucket(bucket, recs, shapes[bucket], control_size(fam, width, height, area))
        keys = _write_bucket(ctx, work, at, roots, encoder, identity, previous, counts)
        _keys_file(work, bucket).write_text(json.dumps(keys if n > 1 else [k[0] for k in keys]))
    ctx.log.info(
        "latents: control latents of %d rows (%d encoded, %d copied)", len(index), counts["encoded"], counts["reused"]
    )
    out = {"controls": len(index), "controls_encoded": counts["encoded"], "controls_reused": counts["reused"]}
    if any(shapes[b] != tuple(shape_of[b]) for b in shapes):  # recorded only where they differ from the targets'
        out["control_shapes"] = {b: list(s) for b, s in shapes.items()}
    return out


@dataclass(frozen=True)
class _Bucket:
    """One bucket's controls: its key, records in row order, control latent shape and pixel size (width, height)."""

    key: str
    recs: list[ImageRecord]
    shape: tuple[int, int, int]
    size: tuple[int, int]


def _write_bucket(ctx, work, at: _Bucket, roots, encoder, identity, previous, counts) -> list[list[str]]:
    """One bucket's arrays; each row's keys, one per reference."""
    bucket, recs, shape, size = at.key, at.recs, at.shape, at.size
    n = len(references(recs[0]))
    if any(len(references(r)) != n for r in recs):  # the scan checks it; a hand-edited record would misalign
        raise ArtifactError(f"images of bucket {bucket} take different numbers of reference images: rescan")
    keys = [[row_key(r, identity, sha, size) for _, sha, _, _ in references(r)] for r in recs]
    flip, dtype = ctx.cfg.latents.flip, np.dtype(ctx.cfg.latents.dtype)
    out = {False: np.zeros((len(recs), n, *shape), dtype)}
    if flip:
        out[True] = np.zeros_like(out[False])
    todo = []
    for i, j in ((i, j) for i in range(len(recs)) for j in range(n)):
        if keys[i][j] in previous.where:
            for flipped in out:
                out[flipped][i, j] = previous.get(keys[i][j], flipped)
            counts["reused"] += 1
        else:
            todo.append((i, j))
    step = ctx.cfg.latents.batch_size
    for part in (todo[k : k + step] for k in range(0, len(todo), step)):
        got = encoder.submit(
            [pixels(recs[i], roots[recs[i].source], j, size) for i, j in part], [recs[i].path for i, _ in part], shape
        )()
        for m, (i, j) in enumerate(part):
            out[False][i, j] = got["mean"][m]
            if flip:
                out[True][i, j] = got["flip_mean"][m]
        counts["encoded"] += len(part)
    check_latents({"mean": out[False].reshape(-1, *shape)}, shape, [r.path for r in recs for _ in range(n)])
    for flipped, arr in out.items():
        np.save(control_file(work, bucket, flipped), arr[:, 0] if n == 1 else arr)
    return keys


@lru_cache(maxsize=64)
def _array(artifact_dir: str, bucket: str, flipped: bool) -> np.ndarray:
    return open_npy(control_file(Path(artifact_dir), bucket, flipped))


def read(reader, batch) -> torch.Tensor | None:
    """(B, C, h, w) float32 control latents of a reader batch ((B, N, C, h, w) for N references per image; the
    flipped control for flipped rows); None when the cache holds none. Checked against the bucket's control shape
    (the manifest's control_shapes, else the targets')."""
    if not getattr(reader.manifest, "controls", 0):
        return None
    flips = batch.flip or (False,) * len(batch.rows)
    rows = [np.asarray(_array(str(reader.dir), batch.bucket, f)[r], np.float32) for r, f in zip(batch.rows, flips)]
    out = torch.from_numpy(np.stack(rows))
    own = (getattr(reader.manifest, "control_shapes", None) or {}).get(batch.bucket)
    expected = tuple(own or reader.shapes[batch.bucket])
    if tuple(out.shape[-3:]) != expected or out.dim() not in (4, 5):
        raise ArtifactError(
            f"control latents of bucket {batch.bucket} in {reader.dir} are {tuple(out.shape[1:])}, the manifest "
            f"says {expected}: rebuild with `tuneline stage latents --force`"
        )
    return out
