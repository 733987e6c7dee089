"""Encode each distinct caption string once (every variant, and the empty caption at row 0) and store every
tensor the family returns."""
from __future__ import annotations

from pathlib import Path

from tuneline.schemas.scan import ScanManifest
from tuneline.schemas.text import PADDING
from tuneline.stages.caption import upstream_captions
from tuneline.stages.common.jsonl import read_jsonl, write_jsonl
from tuneline.stages.common.stage import key_parts
from tuneline.stages.families import resolve as models
from tuneline.stages.families.encode import encode_strings, storage_tensor
from tuneline.stages.text import STAGE, effective_max_length
from tuneline.stages.text.reuse import PreviousStrings
from tuneline.stages.text.store import INDEX, STORE, STRINGS, ArrayWriter
from tuneline.stages.text.variants import TagAugment, index_strings


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
    from_stage = upstream_captions(ctx, upstream)  # with the caption stage on, its captions (scan order)
    captions = list(dict.fromkeys(from_stage.values())) if from_stage is not None else \
        unique_captions(models.artifact_dir(ctx, scan))
    fam = models.family(cfg)
    facts = {"enabled": cfg.text.enabled, "family": fam.facts.name, "encoder_identity": models.identity(ctx, "text"),
             "max_length": effective_max_length(cfg), "padding": PADDING, "variants": augment.variants,
             "augment": augment.as_dict(), "captions": len(captions)}
    if not cfg.text.enabled:
        return facts  # the manifest alone tells consumers how to encode live
    strings, index = index_strings(captions, augment)
    previous = PreviousStrings.latest(ctx, key_parts(ctx, STAGE, {}))
    fields, encoded = write_cache(ctx, work, strings, previous)
    write_jsonl(work / STRINGS, ({"row": i, "text": s} for i, s in enumerate(strings)))
    write_jsonl(work / INDEX, ({"caption": c, "rows": rows} for c, rows in index.items()))
    ctx.log.info("text: %d captions, %d variants each -> %d distinct strings, %d encoded, %d reused from %s",
                 len(captions), augment.variants, len(strings), encoded, len(strings) - encoded,
                 previous.path.name if previous else "-")
    return facts | {"fields": fields, "count": len(strings), "encoded": encoded, "reused": len(strings) - encoded}


def write_cache(ctx, work: Path, strings: list[str], previous: PreviousStrings | None) -> tuple[dict, int]:
    """Write text.zarr row by row in `strings` order: strings the previous version holds are copied, the rest
    encoded in batches. Returns (each field's per-row shape and dtype, strings encoded)."""
    import torch

    cfg = ctx.cfg
    todo = [s for s in strings if previous is None or s not in previous]
    fam, enc = models.family(cfg), None
    if todo:  # a scan that only dropped or reordered captions never loads the encoders
        dev = models.device(cfg)
        enc = fam.load_text_encoders(models.model_dir(ctx), models.dtype(cfg, dev), dev,
                                     max_length=effective_max_length(cfg))
    float_dtype = getattr(torch, cfg.text.dtype)
    writer = ArrayWriter(work / STORE, len(strings))
    bs, done = cfg.text.batch_size, 0
    for window in _windows(strings, previous, bs):
        new = [s for s in window if previous is None or s not in previous]
        old = [s for s in window if previous is not None and s in previous]
        parts = []
        if new:
            out = encode_strings(fam, enc, new, len(new))
            parts.append({k: storage_tensor(v, float_dtype) for k, v in out.items()})
        if old:
            parts.append(previous.take(old))
        # Back into window order: rows were produced new-first, then copied.
        where = {s: i for i, s in enumerate(new + old)}
        order = torch.tensor([where[s] for s in window])
        writer.add({k: torch.cat([p[k] for p in parts])[order] for k in parts[0]})
        done += len(window)
        ctx.reporter.progress("text-progress", done / len(strings), "captions cached")
    return writer.close(), len(todo)


def _windows(strings: list[str], previous: PreviousStrings | None, batch_size: int):
    """Consecutive runs of `strings` holding up to `batch_size` strings to encode (full encoder batches however
    sparse the new strings are), and at most 8 batches of rows, which bounds what is held in memory."""
    start = new = 0
    for i, s in enumerate(strings):
        new += previous is None or s not in previous
        if new == batch_size or i + 1 - start == 8 * batch_size:
            yield strings[start:i + 1]
            start, new = i + 1, 0
    if start < len(strings):
        yield strings[start:]
