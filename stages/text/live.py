"""Text conditioning without the cache: the same `.get(captions, variant_ids=None)` as TextCache, encoded on
the fly, and `open_text`, which gives a consumer whichever of the two its text artifact calls for."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tuneline.schemas.text import TextManifest
from tuneline.stages.families.base import Family
from tuneline.stages.families.encode import encode_strings
from tuneline.stages.text.store import TextCache
from tuneline.stages.text.variants import TagAugment


class LiveText:
    """Runs the family's text encoders per call. Variants are the cache's (same TagAugment), so training does not
    depend on whether the cache is on. Tensors come back on `device` in the encoders' dtype."""

    def __init__(
        self,
        fam: Family,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        max_length: int,
        *,
        augment: TagAugment | None = None,
        batch_size: int = 32,
    ):
        self.fam, self.batch_size = fam, batch_size
        self.augment = augment or TagAugment()
        self.variants = self.augment.variants
        self.enc = fam.load_text_encoders(Path(model_dir), dtype, device, max_length=max_length)
        # The training feed calls get() from several threads; a fast tokenizer's padding/truncation state is not
        # safe to share ("Already borrowed"), and two encoder passes at once would only compete for the cores.
        self._lock = threading.Lock()

    def strings(self, captions: list[str], variant_ids: list[int] | None = None) -> list[str]:
        """The exact string encoded for each sample (variant 0: the caption as written)."""
        ids = [0] * len(captions) if variant_ids is None else list(variant_ids)
        if len(ids) != len(captions):
            raise ValueError(f"{len(ids)} variant ids for {len(captions)} captions")
        return [self.augment.variant(c, v) for c, v in zip(captions, ids)]

    def get(self, captions: list[str], variant_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
        strings = self.strings(captions, variant_ids)
        # Each distinct string once, as in the cache (a batch often repeats the empty caption).
        row = {s: i for i, s in enumerate(dict.fromkeys(strings))}
        with self._lock:
            out = encode_strings(self.fam, self.enc, list(row), self.batch_size)
        pos = torch.tensor([row[s] for s in strings], dtype=torch.long)
        return {k: v[pos.to(v.device)] for k, v in out.items()}


def open_text(
    manifest: TextManifest, artifact_dir: Path, fam: Family, model_dir: Path, device: torch.device, dtype: torch.dtype
) -> TextCache | LiveText:
    """The text source a text artifact calls for: its cache, checked against the manifest's facts, or (built with
    text.enabled false) live encoders with the artifact's max length and variants."""
    if manifest.family != fam.facts.name:
        raise ValueError(
            f"text artifact {artifact_dir} was built for family {manifest.family}, model.family is "
            f"{fam.facts.name}; run `tuneline stage text`"
        )
    if not manifest.enabled:
        return LiveText(fam, model_dir, device, dtype, manifest.max_length, augment=TagAugment.from_manifest(manifest))
    cache = TextCache(artifact_dir, list(manifest.fields))
    for name, spec in manifest.fields.items():
        arr = cache.arrays[name]
        got = (tuple(arr.shape[1:]), str(arr.dtype).removeprefix("torch."))
        if got != (tuple(spec.shape), spec.dtype):
            raise ValueError(
                f"text artifact {artifact_dir}: field {name} holds {got[0]} {got[1]}, its manifest "
                f"says {tuple(spec.shape)} {spec.dtype}; run `tuneline stage text --force`"
            )
    if cache.variants != manifest.variants:
        raise ValueError(
            f"text artifact {artifact_dir} indexes {cache.variants} variants per caption, its manifest "
            f"says {manifest.variants}; run `tuneline stage text --force`"
        )
    return cache
