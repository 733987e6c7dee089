"""Zarr layout of the text cache: text.zarr/<field> (N, ...) + captions.jsonl (row -> caption).

Row 0 is always the empty caption: caption dropout and unconditional validation read it from the cache.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import zarr

from stages.common.jsonl import read_jsonl

STORE = "text.zarr"
CAPTIONS = "captions.jsonl"


class TextCache:
    """Read side: caption -> tensors. The whole cache is small next to latents, so it is read into memory once."""

    def __init__(self, artifact_dir: Path, fields: list[str]):
        group = zarr.open_group(str(artifact_dir / STORE), mode="r")
        self.arrays = {f: torch.from_numpy(np.asarray(group[f][:])) for f in fields}
        self.rows = {r["caption"]: r["row"] for r in read_jsonl(artifact_dir / CAPTIONS)}

    def get(self, captions: list[str]) -> dict[str, torch.Tensor]:
        missing = [c for c in captions if c not in self.rows]
        if missing:
            raise KeyError(f"caption not in the text cache: {missing[0]!r}; rebuild it with `tuneline stage text`")
        idx = torch.tensor([self.rows[c] for c in captions])
        return {f: a[idx] for f, a in self.arrays.items()}
