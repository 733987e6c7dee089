"""Latent caching: one process, the family's VAE, batches within a bucket, shapes checked on write."""
from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from schemas.scan import ImageRecord, Rejected, ScanManifest
from stages.common import models
from stages.common.artifacts import safe_join
from stages.common.jsonl import read_jsonl, write_jsonl
from stages.common.sizing import latent_shape
from stages.latents import store
from stages.scan.images import load_rgb


class LatentShapeError(RuntimeError):
    pass


def read_records(scan_dir: Path) -> list[ImageRecord]:
    return [ImageRecord.model_validate(r) for r in read_jsonl(scan_dir / "images.jsonl")]


def to_pixels(img: Image.Image, rec: ImageRecord) -> torch.Tensor:
    """Crop the recorded box and resize to the recorded bucket: (3, H, W) in [-1, 1]."""
    img = img.crop(rec.crop).resize((rec.bucket_width, rec.bucket_height), Image.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1)


def _prepare(root: Path, rec: ImageRecord) -> torch.Tensor | str:
    try:
        return to_pixels(load_rgb(safe_join(root, rec.path)), rec)
    except (OSError, ValueError, SyntaxError) as err:  # truncated/corrupt files surface only when decoded
        return f"cannot decode at caching time: {type(err).__name__}: {err}"


def check_latents(mean: torch.Tensor, std: torch.Tensor, expected: tuple[int, int, int], paths: list[str]) -> None:
    for i, path in enumerate(paths):
        if tuple(mean[i].shape) != expected:
            raise LatentShapeError(f"latent shape mismatch for image {path}: expected {expected}, "
                                   f"got {tuple(mean[i].shape)}; its bucket size and the VAE disagree")
        if not (torch.isfinite(mean[i]).all() and torch.isfinite(std[i]).all()):
            raise LatentShapeError(f"VAE produced NaN/Inf latents for image {path}: check the image and the "
                                   f"VAE dtype (model.dtype)")


def build(ctx, work: Path, upstream: dict) -> dict:
    cfg = ctx.cfg
    scan: ScanManifest = upstream["scan"]
    records = read_records(models.artifact_dir(ctx, scan))
    root = Path(scan.dataset_root)
    fam = models.family(cfg)
    dev = models.device(cfg)
    vae = fam.load_vae(models.model_dir(ctx), models.dtype(cfg, dev), dev)
    scale, shift = fam.vae_factors(vae)
    by_bucket: dict[tuple[int, int], list[ImageRecord]] = defaultdict(list)
    for r in records:
        by_bucket[(r.bucket_width, r.bucket_height)].append(r)

    index, rejected, buckets, done = [], [], [], 0
    with ThreadPoolExecutor(max(1, cfg.latents.workers)) as pool:
        for (bw, bh), recs in sorted(by_bucket.items()):
            shape = latent_shape(bw, bh, fam.facts.latent_channels, fam.facts.vae_factor)
            pixels = list(pool.map(lambda r: _prepare(root, r), recs))  # decode overlaps with nothing yet
            ok = [(r, p) for r, p in zip(recs, pixels) if isinstance(p, torch.Tensor)]
            rejected += [Rejected(path=r.path, reason=p) for r, p in zip(recs, pixels) if isinstance(p, str)]
            if not ok:
                continue
            group = store.create_bucket(work, bw, bh, shape, len(ok), cfg.latents.dtype)
            for start in range(0, len(ok), cfg.latents.batch_size):
                chunk = ok[start:start + cfg.latents.batch_size]
                x = torch.stack([p for _, p in chunk]).to(dev, vae.dtype)
                with torch.no_grad():
                    dist = vae.encode(x).latent_dist
                mean, std = dist.mean.float().cpu(), dist.std.float().cpu()
                check_latents(mean, std, shape, [r.path for r, _ in chunk])
                group["mean"][start:start + len(chunk)] = mean.numpy().astype(cfg.latents.dtype)
                group["std"][start:start + len(chunk)] = std.numpy().astype(cfg.latents.dtype)
                done += len(chunk)
                ctx.reporter.progress("latents-progress", done / max(1, len(records)), f"{done} images encoded")
            index += [{"path": r.path, "bucket": store.bucket_key(bw, bh), "row": i} for i, (r, _) in enumerate(ok)]
            buckets.append({"width": bw, "height": bh, "shape": shape, "count": len(ok),
                            "array": store.bucket_key(bw, bh)})
    write_jsonl(work / store.INDEX, index)
    write_jsonl(work / "rejected.jsonl", rejected)
    if not index:
        raise RuntimeError(f"no image of scan version {scan.fingerprint} could be encoded; see the reasons in "
                           f"the latents rejected.jsonl and fix the dataset")
    return {"family": fam.facts.name, "vae_identity": models.identity(ctx, "vae"),
            "vae_factor": fam.facts.vae_factor, "latent_channels": fam.facts.latent_channels,
            "scaling_factor": scale, "shift_factor": shift, "dtype": cfg.latents.dtype,
            "buckets": buckets, "count": len(index), "rejected": len(rejected)}
