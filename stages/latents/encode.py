"""Pixels in, checked latent distributions out: the decode side (worker threads) and the VAE side."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tuneline.schemas.scan import ImageRecord, Location
from tuneline.stages.common.stage import StageFailed
from tuneline.stages.latents import store
from tuneline.stages.scan.images import load_rgb
from tuneline.stages.scan.members import image_source
from tuneline.stages.scan.video import ClipChanged, load_clip

# What PIL raises on a file whose header parsed but whose pixel data is broken (truncated, bad zlib stream).
DECODE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    IndexError,
    KeyError,
    zlib.error,
    Image.DecompressionBombError,
)


class LatentShapeError(RuntimeError):
    """The VAE's output for an image does not match what its bucket requires, or is not finite."""


def to_pixels(img: Image.Image, rec: ImageRecord, size: tuple[int, int] | None = None) -> torch.Tensor:
    """Crop the recorded box and resize to the recorded bucket (or to `size`, (width, height)): (3, H, W) float32
    in [-1, 1]."""
    img = img.crop(rec.crop).resize(size or (rec.bucket_width, rec.bucket_height), Image.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1)


def prepare(root: Path | Location, rec: ImageRecord) -> torch.Tensor | str:
    """The image's pixels, or the reason it cannot be cached (runs in a worker thread; PIL releases the GIL).

    The bytes must still be the ones the scan hashed: a row's cache key is that hash. A webdataset or parquet
    image is read by its record (stages/scan/members.py), never extracted.
    """
    try:
        sha, source = image_source(root, rec)
    except OSError as err:
        if rec.shard is None:
            return _undecodable(err)
        # The store or the shard, not the image: the stage fails (nothing is published) instead of dropping it.
        raise StageFailed(
            f"reading {rec.path} from shard {rec.shard} failed ({type(err).__name__}: {err}): if the shard changed "
            "since the scan run `tuneline stage scan`, else check the storage and rerun `tuneline stage latents`"
        ) from err
    try:
        if sha != rec.sha256:
            return "the file changed since the scan (content hash differs): run `tuneline stage scan` again"
        if rec.start is not None:  # a clip: (3, F, H, W), every frame cropped and sized as the scan recorded
            return torch.stack([to_pixels(frame, rec) for frame in load_clip(source, rec)], dim=1)
        return to_pixels(load_rgb(source, rec), rec)
    except ClipChanged as err:
        return str(err)
    except DECODE_ERRORS as err:
        return _undecodable(err)


def _undecodable(err: Exception) -> str:
    return f"cannot decode at caching time ({type(err).__name__}: {err}): re-export or remove the file"


PIN_LIMIT = 1 << 28  # bytes of a batch's pixels sent from page-locked memory


class Encoder:
    """The family's VAE on its device; returns every stored array for a batch, checked, in the stored dtype."""

    def __init__(self, vae: torch.nn.Module, device: torch.device, dtype: str, flip: bool):
        self.vae, self.device, self.dtype, self.flip = vae, device, np.dtype(dtype), flip

    def submit(
        self, pixels: list[torch.Tensor], paths: list[str], expected: tuple[int, int, int]
    ) -> Callable[[], dict[str, np.ndarray]]:
        """Start a batch; returns the call that waits for its arrays. On CUDA nothing here waits for the device:
        the pixels go up from pinned memory and the latents come back into it as the device finishes them, so
        the host can stack the next batch, check the last one and write blocks meanwhile. On the CPU the batch is
        done when this returns."""
        cuda = self.device.type == "cuda"
        shape = (len(pixels), *pixels[0].shape)
        # Page-locked buffers stay cached by size for the process: a batch of long clips (GBs) goes pageable.
        pin = cuda and math.prod(shape) * pixels[0].element_size() <= PIN_LIMIT
        x = torch.empty(shape, dtype=pixels[0].dtype, pin_memory=pin)
        torch.stack(pixels, out=x)
        x = x.to(self.device, non_blocking=cuda).to(self.vae.dtype)
        if self.flip:
            x = torch.cat([x, x.flip(-1)])  # one forward for both variants
        with torch.no_grad():
            dist = self.vae.encode(x).latent_dist
        n = len(paths)
        parts = {"mean": dist.mean[:n], "std": dist.std[:n]}
        if self.flip:
            parts |= {"flip_mean": dist.mean[n:], "flip_std": dist.std[n:]}
        host = {k: v.float().to("cpu", non_blocking=cuda) for k, v in parts.items()}  # pinned when non-blocking
        done = torch.cuda.Event(blocking=True) if cuda else None  # its wait sleeps: decode threads get the core
        if done is not None:
            done.record(torch.cuda.current_stream(self.device))

        def result() -> dict[str, np.ndarray]:
            if done is not None:
                done.synchronize()
            out = {k: v.numpy().astype(self.dtype) for k, v in host.items()}
            check_latents(out, expected, paths)
            return out

        return result


def check_latents(arrays: dict[str, np.ndarray], expected: tuple[int, int, int], paths: list[str]) -> None:
    """Shape and finiteness of every row, after the cast to the stored dtype (float16 can overflow)."""
    for name, arr in arrays.items():
        variant = " (flipped)" if name in store.FLIPPED else ""
        for i, path in enumerate(paths):
            if tuple(arr[i].shape) != expected:
                raise LatentShapeError(
                    f"latent shape mismatch for image {path}{variant}: expected {expected}, "
                    f"got {tuple(arr[i].shape)}; its bucket size and the VAE disagree"
                )
        bad = ~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)
        if bad.any():
            path = paths[int(np.argmax(bad))]
            raise LatentShapeError(
                f"the VAE produced NaN/Inf latent {name} for image {path}{variant} (stored as "
                f"{arr.dtype}): check the image, run the VAE in float32 (model.dtype) or "
                f"store float32 (latents.dtype)"
            )


def vae_facts_of(fam, vae) -> dict:
    """What the latents manifest records of the VAE's normalisation: scalars and, where the family has them,
    per-channel statistics."""
    scale, shift = fam.vae_factors(vae)
    mean, std = fam.latent_stats(vae) or (None, None)
    return {"scaling_factor": scale, "shift_factor": shift, "latents_mean": mean, "latents_std": std}
