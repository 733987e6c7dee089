"""The demo's learning check: do samples for class c land nearest to class c's mean cached latent?

Latents are compared by their per-channel means in the denoiser's (scaled) space: buckets differ in shape,
and the demo's classes are colors, which the channel means carry.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from schemas.demo import DEMO_COLORS, DEMO_SHAPES
from schemas.latents import LatentsManifest
from stages.common.jsonl import read_jsonl
from stages.latents import store
from stages.train.objective import scale_latents


def class_means(latents_dir: Path, manifest: LatentsManifest, scan_dir: Path) -> dict[str, np.ndarray]:
    captions = {r["path"]: r["caption"] for r in read_jsonl(scan_dir / "images.jsonl")}
    sums: dict[str, list[np.ndarray]] = defaultdict(list)
    blocks = {}
    for b in manifest.buckets:
        mean, _ = store.read_block(store.open_bucket(latents_dir, b.width, b.height), 0, b.count)
        blocks[b.array] = scale_latents(torch.from_numpy(mean.astype(np.float32)), manifest.scaling_factor,
                                        manifest.shift_factor).mean(dim=(2, 3)).numpy()
    for row in read_jsonl(latents_dir / store.INDEX):
        words = captions.get(row["path"], "").split()
        for color in DEMO_COLORS:
            if color in words:
                sums[color].append(blocks[row["bucket"]][row["row"]])
    return {c: np.mean(v, axis=0) for c, v in sums.items() if v}


def learning_check(renderer, latents_dir: Path, manifest: LatentsManifest, cfg, size: tuple[int, int]) -> float:
    """Fraction of (class, seed) samples whose nearest class mean is their own class."""
    scan_dir = latents_dir.parent.parent / "scan" / manifest.upstream["scan"]
    means = class_means(latents_dir, manifest, scan_dir)
    names = sorted(means)
    centers = np.stack([means[n] for n in names])
    v = cfg.validate_
    hits = total = 0
    for c in names:
        for seed in range(v.check_seeds):
            prompt = f"a {c} {DEMO_SHAPES[seed % len(DEMO_SHAPES)]}"
            lat = renderer(prompt, "", 1000 + seed, *size, v.steps, v.guidance_scale, output_type="latent")
            vec = torch.as_tensor(lat).float().mean(dim=(2, 3))[0].cpu().numpy()
            nearest = names[int(np.argmin(((centers - vec) ** 2).sum(axis=1)))]
            hits += nearest == c
            total += 1
    return hits / max(1, total)
