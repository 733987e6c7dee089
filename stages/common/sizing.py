"""THE size function. Every stage that needs a target size (scan, latents, train, validate) gets it here.

Resolution units (docs/design.md):
  pixel       shorter edge in pixels
  area        megapixels, 1.0 = 1024 x 1024 pixels
  pixel_area  an edge length whose square is the target area
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

ResolutionType = Literal["pixel", "area", "pixel_area"]
MEGAPIXEL = 1024 * 1024


@dataclass(frozen=True)
class SizePolicy:
    resolution: float
    resolution_type: ResolutionType
    alignment: int
    min_aspect: float = 0.25
    max_aspect: float = 4.0
    upscale: bool = True
    min_edge: int = 0  # images whose shorter edge (after EXIF orientation) is below this are rejected


def target_area(resolution: float, resolution_type: ResolutionType) -> float:
    """Target area in square pixels (for `pixel`, the area of the square bucket)."""
    if resolution_type == "area":
        return resolution * MEGAPIXEL
    if resolution_type in ("pixel_area", "pixel"):
        return resolution * resolution
    raise ValueError(f"buckets.resolution_type: unknown {resolution_type!r}; use pixel, area or pixel_area")


def clamp_aspect(width: int, height: int, policy: SizePolicy) -> float:
    return min(max(width / height, policy.min_aspect), policy.max_aspect)


def usable_region(width: int, height: int, aspect: float) -> tuple[float, float]:
    """The largest region of a width x height image with this aspect (what a crop can keep)."""
    return (height * aspect, float(height)) if width / height > aspect else (float(width), width / aspect)


def _ideal(aspect: float, policy: SizePolicy) -> tuple[float, float]:
    """Unaligned target (w, h) with this aspect at the policy's resolution."""
    if policy.resolution_type == "pixel":
        short = policy.resolution
        return (short * aspect, short) if aspect >= 1 else (short, short / aspect)
    h = math.sqrt(target_area(policy.resolution, policy.resolution_type) / aspect)
    return h * aspect, h


def _align(x: float, alignment: int, *, floor: bool) -> int:
    n = math.floor(x / alignment + 1e-9) if floor else round(x / alignment)
    return max(1, n) * alignment


def size_problem(width: int, height: int, policy: SizePolicy) -> str | None:
    """Why an image of this size cannot be bucketed under the policy (None = it can)."""
    if width <= 0 or height <= 0:
        return f"image size {width}x{height} is not positive"
    if min(width, height) < policy.min_edge:
        return (
            f"image is {width}x{height}, its shorter edge is below buckets.min_edge {policy.min_edge}; "
            f"use a larger image or lower buckets.min_edge"
        )
    cw, ch = usable_region(width, height, clamp_aspect(width, height, policy))
    if not policy.upscale and min(cw, ch) < policy.alignment:
        return (
            f"image is {width}x{height}: with buckets.upscale false its crop ({cw:.0f}x{ch:.0f}) is smaller "
            f"than one alignment unit ({policy.alignment} px); allow upscaling or remove the image"
        )
    return None


def bucket_size(width: int, height: int, policy: SizePolicy) -> tuple[int, int]:
    """(bucket_width, bucket_height) for an image of this size: aligned, aspect clamped to the policy.

    Edges are rounded to the nearest multiple of the alignment; without upscaling the bucket is shrunk to
    the usable crop and rounded down, so no bucket edge exceeds the source pixels it is made from.
    """
    problem = size_problem(width, height, policy)
    if problem:
        raise ValueError(problem)
    aspect = clamp_aspect(width, height, policy)
    w, h = _ideal(aspect, policy)
    bw, bh = _align(w, policy.alignment, floor=False), _align(h, policy.alignment, floor=False)
    if not policy.upscale:
        cw, ch = usable_region(width, height, aspect)
        if bw > cw or bh > ch:
            scale = min(1.0, cw / w, ch / h)
            bw, bh = _align(w * scale, policy.alignment, floor=True), _align(h * scale, policy.alignment, floor=True)
    return bw, bh


def crop_box(
    width: int, height: int, bucket_w: int, bucket_h: int, mode: str = "center", seed: int = 0, key: str = ""
) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the original image region that is resized to the bucket.

    `random` is seeded by (seed, key) so a rescan reproduces the recorded crop.
    """
    ta = bucket_w / bucket_h
    if width / height > ta:
        ch, cw = height, max(1, min(width, round(height * ta)))
    else:
        cw, ch = width, max(1, min(height, round(width / ta)))
    if mode == "center":
        left, top = (width - cw) // 2, (height - ch) // 2
    elif mode == "corner":
        left, top = 0, 0
    elif mode == "random":
        h = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")
        left = h % (width - cw + 1)
        top = (h // (width - cw + 1)) % (height - ch + 1)
    else:
        raise ValueError(f"buckets.crop: unknown crop mode {mode!r}; use center, random or corner")
    return left, top, left + cw, top + ch


def latent_shape(bucket_w: int, bucket_h: int, channels: int, vae_factor: int, frames: int = 1) -> tuple[int, int, int]:
    """The (C, H, W) a VAE writes for a bucket: the cache and the reader both check against this. A clip's `frames`
    latent frames are stacked along H: (C, frames * h, w)."""
    if bucket_w % vae_factor or bucket_h % vae_factor:
        raise ValueError(f"bucket {bucket_w}x{bucket_h} is not a multiple of the VAE factor {vae_factor}")
    return channels, frames * (bucket_h // vae_factor), bucket_w // vae_factor


def latent_frames(frames: int, temporal: int) -> int:
    """Latent frames of a clip of `frames` frames through a causal video VAE that folds `temporal` frames into one
    after the first (Wan: 4k+1 frames -> k+1); 1 for an image family (temporal 0) or a one-frame clip."""
    if not temporal or frames <= 1:
        return 1
    if (frames - 1) % temporal:
        raise ValueError(f"a clip of {frames} frames breaks the {temporal}k+1 frame rule of its family's VAE")
    return (frames - 1) // temporal + 1


def render_size(
    resolution: float, resolution_type: ResolutionType, alignment: int, aspect: float = 1.0
) -> tuple[int, int]:
    """Validation render size: the same function applied to a virtual image of the requested aspect."""
    policy = SizePolicy(resolution, resolution_type, alignment, min_aspect=aspect, max_aspect=aspect)
    return bucket_size(max(1, round(1000 * aspect)), 1000, policy)


def size_policy(buckets, family_alignment: int) -> SizePolicy:
    """The policy a config's `buckets` section means (alignment null = the family's requirement)."""
    return SizePolicy(
        resolution=buckets.resolution,
        resolution_type=buckets.resolution_type,
        alignment=buckets.alignment or family_alignment,
        min_aspect=buckets.min_aspect,
        max_aspect=buckets.max_aspect,
        upscale=buckets.upscale,
        min_edge=buckets.min_edge,
    )


@dataclass(frozen=True)
class FramePolicy:
    """How a clip's frames are bucketed: the rate it is trained at, the frame budgets, the family's rule (frames =
    factor * k + 1) and which part of a longer clip is kept (`start`, `center`, `every`)."""

    fps: float
    budgets: tuple[int, ...]
    factor: int
    clip: Literal["start", "center", "every"] = "start"


def frame_count(source_frames: int, source_fps: float, policy: FramePolicy) -> int:
    """The frames a clip trains with: the largest budget its length at policy.fps holds, or, shorter than every
    budget, the largest count the family's rule allows (a one-frame clip at least: an image)."""
    available = max(1, math.floor(source_frames * policy.fps / source_fps + 1e-9)) if source_fps > 0 else 1
    fitting = [b for b in policy.budgets if b <= available]
    return max(fitting) if fitting else (available - 1) // policy.factor * policy.factor + 1


def clip_ranges(source_frames: int, source_fps: float, policy: FramePolicy) -> list[tuple[int, float, float]]:
    """(frames, start, end) of each clip cut from a file, times in seconds in the file: its start, its center,
    or every consecutive part that holds the bucket's frames (buckets.clip)."""
    frames = frame_count(source_frames, source_fps, policy)
    length = frames / policy.fps
    duration = source_frames / source_fps if source_fps > 0 else 0.0
    if policy.clip == "every":
        starts = [i * length for i in range(max(1, math.floor(duration / length + 1e-9)))]
    elif policy.clip == "center":
        starts = [max(0.0, (duration - length) / 2)]
    else:
        starts = [0.0]
    return [(frames, round(s, 6), round(s + length, 6)) for s in starts]


def frame_indices(start: float, frames: int, fps: float, source_fps: float, source_frames: int) -> list[int]:
    """The file's frame index for each trained frame: frame i sits at start + i / fps, the nearest earlier source
    frame (a file slower than fps repeats frames). What the latents stage decodes."""
    return [min(source_frames - 1, math.floor((start + i / fps) * source_fps + 1e-6)) for i in range(frames)]
