"""The one way strings become tensors, shared by the cache writer, live encoding and validation prompts, so a
cached embedding and a live one come from the same calls."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tuneline.stages.families.base import Family, TextEncoders


def encode_batches(
    fam: Family, enc: TextEncoders, strings: list[str], batch_size: int
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(start row, every tensor the family returns for strings[start:start + batch_size]) per batch."""
    for start in range(0, len(strings), batch_size):
        with torch.no_grad():
            out = fam.encode_text(enc, strings[start : start + batch_size])
        yield start, {k: v.detach() for k, v in out.items()}


def encode_strings(fam: Family, enc: TextEncoders, strings: list[str], batch_size: int = 32) -> dict[str, torch.Tensor]:
    """All of `strings` encoded, batch first, on the encoders' device and dtype."""
    parts: dict[str, list[torch.Tensor]] = {}
    for _, out in encode_batches(fam, enc, strings, batch_size):
        for k, v in out.items():
            parts.setdefault(k, []).append(v)
    return {k: torch.cat(v) for k, v in parts.items()}


def storage_tensor(t: torch.Tensor, float_dtype: torch.dtype) -> torch.Tensor:
    """A tensor as the cache stores it: on the CPU, floats in the stored dtype (via float32, since bfloat16 has no
    numpy form), integer and bool tensors (attention masks) unchanged."""
    t = t.detach().cpu()
    return t.float().to(float_dtype) if t.is_floating_point() else t
