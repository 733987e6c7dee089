"""Zarr layout of the latent cache.

latents.zarr/
  <W>x<H>/mean   (N, C, h, w)  latent distribution mean, one row per image
  <W>x<H>/std    (N, C, h, w)  latent distribution std (training samples mean + std * eps)
index.jsonl      one row per cached image: {"path", "bucket", "row"}

Arrays are chunked in blocks of rows along N so the reader fetches whole blocks, never single rows
(PLATFORM.md: single-row Zarr reads are 10x slower than block reads).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr

STORE = "latents.zarr"
INDEX = "index.jsonl"
BLOCK_ROWS = 64


def bucket_key(width: int, height: int) -> str:
    return f"{width}x{height}"


def create_bucket(root: Path, width: int, height: int, shape: tuple[int, int, int], count: int,
                  dtype: str) -> zarr.Group:
    group = zarr.open_group(str(root / STORE), mode="a").require_group(bucket_key(width, height))
    for name in ("mean", "std"):
        group.create_array(name, shape=(count, *shape), chunks=(min(BLOCK_ROWS, max(count, 1)), *shape),
                           dtype=dtype, overwrite=True, fill_value=0)
    return group


def open_bucket(root: Path, width: int, height: int) -> zarr.Group:
    return zarr.open_group(str(root / STORE / bucket_key(width, height)), mode="r")


def read_block(group: zarr.Group, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    return group["mean"][start:stop], group["std"][start:stop]
