"""Encode each distinct caption string once (every variant, and the empty caption at row 0) and store every
tensor the family returns."""
from __future__ import annotations

from pathlib import Path

from schemas.scan import ScanManifest
from schemas.text import PADDING
from stages.common import models
from stages.common.jsonl import read_jsonl, write_jsonl
from stages.text import effective_max_length
from stages.text.encode import encode_batches, storage_tensor
from stages.text.store import INDEX, STORE, STRINGS, ArrayWriter
from stages.text.variants import TagAugment, index_strings


def unique_captions(scan_dir: Path) -> list[str]:
    """Each distinct caption of the scan in first-seen order."""
    seen: dict[str, None] = {}
    for r in read_jsonl(scan_dir / "images.jsonl"):
        seen.setdefault(r["caption"], None)
    return list(seen)


def build(ctx, work: Path, upstream: dict) -> dict:
    cfg = ctx.cfg
    scan: ScanManifest = upstream["scan"]
    augment = TagAugment.from_config(cfg.text)
    captions = unique_captions(models.artifact_dir(ctx, scan))
    fam = models.family(cfg)
    facts = {"enabled": cfg.text.enabled, "family": fam.facts.name, "encoder_identity": models.identity(ctx, "text"),
             "max_length": effective_max_length(cfg), "padding": PADDING, "variants": augment.variants,
             "augment": augment.as_dict(), "captions": len(captions)}
    if not cfg.text.enabled:
        return facts  # the manifest alone tells consumers how to encode live
    strings, index = index_strings(captions, augment)
    fields = write_cache(ctx, work, strings)
    write_jsonl(work / STRINGS, ({"row": i, "text": s} for i, s in enumerate(strings)))
    write_jsonl(work / INDEX, ({"caption": c, "rows": rows} for c, rows in index.items()))
    ctx.log.info("text: %d captions, %d variants each -> %d distinct strings encoded", len(captions),
                 augment.variants, len(strings))
    return facts | {"fields": fields, "count": len(strings)}


def write_cache(ctx, work: Path, strings: list[str]) -> dict[str, dict]:
    """Encode `strings` in batches into text.zarr; returns each field's per-row shape and dtype."""
    import torch

    cfg = ctx.cfg
    fam, dev = models.family(cfg), models.device(cfg)
    enc = fam.load_text_encoders(models.model_dir(ctx), models.dtype(cfg, dev), dev,
                                 max_length=effective_max_length(cfg))
    float_dtype = getattr(torch, cfg.text.dtype)
    writer = ArrayWriter(work / STORE, len(strings))
    bs = cfg.text.batch_size
    for start, out in encode_batches(fam, enc, strings, bs):
        writer.add({k: storage_tensor(v, float_dtype) for k, v in out.items()})
        ctx.reporter.progress("text-progress", min(1.0, (start + bs) / len(strings)), "captions encoded")
    return writer.close()
