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
from tuneline.stages.text.controls import CONTROLS, encode_keys, index_pairs, paired_captions
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
    captions = (
        list(dict.fromkeys(from_stage.values()))
        if from_stage is not None
        else unique_captions(models.artifact_dir(ctx, scan))
    )
    fam = models.family(cfg)
    paired = paired_captions(ctx, scan, upstream)  # a family whose text encoder sees the controls, with pairs
    if paired is not None:
        check_paired(cfg)
        captions = [c for c, _ in paired[0]]
    facts = {
        "enabled": cfg.text.enabled,
        "family": fam.facts.name,
        "encoder_identity": models.identity(ctx, "text"),
        "max_length": effective_max_length(cfg),
        "padding": PADDING,
        "variants": augment.variants,
        "augment": augment.as_dict(),
        "captions": len(captions),
    }
    if not cfg.text.enabled:
        return facts  # the manifest alone tells consumers how to encode live
    strings, index = index_pairs(paired[0], augment) if paired else index_strings(captions, augment)
    files = paired[1] if paired else None
    previous = PreviousStrings.latest(ctx, key_parts(ctx, STAGE, {}))
    shards = None
    if cfg.text.shards > 1 and any(previous is None or s not in previous for s in strings):
        from tuneline.stages.text import shard

        staged, shards = shard.build_sharded(ctx, work, {"scan": scan.fingerprint})
        fields, encoded = write_cache(ctx, work, strings, previous, staged, files=files)
    else:
        fields, encoded = write_cache(ctx, work, strings, previous, files=files)
    if files is not None:
        write_jsonl(work / CONTROLS, ({"sha256": sha, "path": str(p)} for sha, p in files.items()))
    write_jsonl(work / STRINGS, ({"row": i, "text": s} for i, s in enumerate(strings)))
    write_jsonl(work / INDEX, ({"caption": c, "rows": rows} for c, rows in index.items()))
    ctx.log.info(
        "text: %d captions, %d variants each -> %d distinct strings, %d encoded, %d reused from %s",
        len(captions),
        augment.variants,
        len(strings),
        encoded,
        len(strings) - encoded,
        previous.path.name if previous else "-",
    )
    return facts | {
        "fields": fields,
        "count": len(strings),
        "encoded": encoded,
        "reused": len(strings) - encoded,
        **({"shards": shards} if shards else {}),
    }


def wanted_strings(ctx, scan: ScanManifest) -> list[str]:
    """Every distinct string (or pair key) the cache holds, in row order (what a shard recomputes to find its
    windows)."""
    augment = TagAugment.from_config(ctx.cfg.text)
    paired = paired_captions(ctx, scan, {})
    if paired is not None:
        return index_pairs(paired[0], augment)[0]
    return index_strings(unique_captions(models.artifact_dir(ctx, scan)), augment)[0]


def check_paired(cfg) -> None:
    """Rows per (instruction, control image) exist only in the cache: live encoding takes strings alone."""
    if not cfg.text.enabled:
        raise ValueError(
            f"text.enabled: false, but model.family {cfg.model.family}'s text encoder sees the control images of "
            f"dataset.control, which only the text cache encodes: set text.enabled true and run `tuneline stage text`"
        )


class Encoders:
    """The family's text encoders, loaded on first use, once: a scan that only dropped or reordered captions (or a
    shard whose windows are all done) never loads them."""

    def __init__(self, ctx, files: dict | None = None):
        self.ctx, self.enc, self.files = ctx, None, files

    def __call__(self, new: list[str]) -> dict:
        import torch

        cfg = self.ctx.cfg
        fam = models.family(cfg)
        if self.enc is None:
            dev = models.device(cfg)
            self.enc = fam.load_text_encoders(
                models.model_dir(self.ctx), models.dtype(cfg, dev), dev, max_length=effective_max_length(cfg)
            )
            self.enc.input_area = models.input_area(cfg)
        if self.files is not None:  # (instruction, control image) pair keys
            out = encode_keys(fam, self.enc, new, self.files, len(new))
        else:
            out = encode_strings(fam, self.enc, new, len(new))
        return {k: storage_tensor(v, getattr(torch, cfg.text.dtype)) for k, v in out.items()}


def write_cache(
    ctx, work: Path, strings: list[str], previous: PreviousStrings | None, staged=None, files: dict | None = None
) -> tuple[dict, int]:
    """Write text.zarr row by row in `strings` order: strings the previous version holds are copied, the rest
    encoded in batches (or taken from what shards encoded: `staged(window number, new strings)` gives a window's
    rows or None); with `files` (sha256 -> control image) the strings are pair keys (stages/text/controls.py).
    Returns (each field's per-row shape and dtype, strings encoded)."""
    import torch

    cfg = ctx.cfg
    todo = [s for s in strings if previous is None or s not in previous]
    encode = Encoders(ctx, files)
    writer = ArrayWriter(work / STORE, len(strings))
    bs, done = cfg.text.batch_size, 0
    for number, window in enumerate(windows(strings, previous, bs)):
        new = [s for s in window if previous is None or s not in previous]
        old = [s for s in window if previous is not None and s in previous]
        parts = []
        if new:
            got = staged(number, new) if staged is not None else None
            parts.append(got if got is not None else encode(new))
        if old:
            parts.append(previous.take(old))
        # Back into window order: rows were produced new-first, then copied.
        where = {s: i for i, s in enumerate(new + old)}
        order = torch.tensor([where[s] for s in window])
        writer.add({k: torch.cat([p[k] for p in parts])[order] for k in parts[0]})
        done += len(window)
        ctx.reporter.progress("text-progress", done / len(strings), "captions cached")
    return writer.close(), len(todo)


def windows(strings: list[str], previous: PreviousStrings | None, batch_size: int):
    """Consecutive runs of `strings` holding up to `batch_size` strings to encode (full encoder batches however
    sparse the new strings are), and at most 8 batches of rows, which bounds what is held in memory."""
    start = new = 0
    for i, s in enumerate(strings):
        new += previous is None or s not in previous
        if new == batch_size or i + 1 - start == 8 * batch_size:
            yield strings[start : i + 1]
            start, new = i + 1, 0
    if start < len(strings):
        yield strings[start:]
