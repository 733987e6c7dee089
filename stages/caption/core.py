"""Build captions.jsonl: decide per image whether the model speaks (caption.policy), reuse every model caption the
published versions (or this version's interrupted build) already made with the same model and settings, generate
the rest in batches on the model's device, and combine user caption, model caption and trigger.

Kill safety: generated captions are appended to `generated.jsonl` in the work-in-progress folder after each batch;
a killed build publishes nothing (the stage runner publishes only a finished build) and its rerun continues from
what that file holds.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tuneline.schemas.caption import CaptionManifest
from tuneline.schemas.scan import ImageRecord, ScanManifest
from tuneline.schemas.sources import dataset_sources
from tuneline.stages.caption import CAPTIONS, generation_key, model as vlm
from tuneline.stages.common.artifacts import ArtifactError, safe_join
from tuneline.stages.common.jsonl import read_jsonl, write_jsonl

GENERATED = "generated.jsonl"  # in the work folder only: {sha256, key, caption} per generated caption


@dataclass
class Item:
    record: ImageRecord
    user: str  # the user's caption ("" when none)
    needs_model: bool


def user_caption(rec: ImageRecord, kept_empty: bool) -> tuple[str, bool]:
    """(the user's caption, whether the user gave one). A file-name caption is no user caption; an empty sidecar
    is one only when dataset.empty_caption keeps empty captions (`kept_empty`)."""
    if rec.caption_source in ("sidecar", "metadata") and rec.caption:
        return rec.caption, True
    return "", kept_empty


def plan(records: list[ImageRecord], cfg, roots: dict) -> list[Item]:
    """One item per image (records repeat an image per buckets.resolutions entry), in scan order."""
    ext = {s.index: s.caption_extension or cfg.dataset.caption_extension for s in dataset_sources(cfg)}
    policy, items, seen = cfg.caption.policy, [], set()
    for rec in records:
        if rec.ref in seen:
            continue
        seen.add(rec.ref)
        sidecar = Path(os.path.splitext(rec.path)[0] + ext.get(rec.source, cfg.dataset.caption_extension))
        kept_empty = (
            cfg.dataset.empty_caption == "keep"
            and rec.caption_source == "none"
            and rec.shard is None  # a shard's captions are members, never files beside it
            and safe_join(roots[rec.source], sidecar.as_posix()).is_file()
        )
        user, given = user_caption(rec, kept_empty)
        items.append(Item(rec, user, needs_model=policy != "missing" or not given))
    return items


def combine(item: Item, model_caption: str | None, cfg) -> tuple[str, str]:
    """(the caption training sees, source). prefix: the model's words first; suffix: after the user's."""
    c = cfg.caption
    if not item.needs_model:
        body, source = item.user, "user"
    elif c.policy in ("prefix", "suffix") and item.user:
        parts = [model_caption, item.user] if c.policy == "prefix" else [item.user, model_caption]
        body, source = ", ".join(p for p in parts if p), "model"
    else:
        body, source = model_caption or "", "model"
    if c.trigger and not (body == c.trigger or body.startswith(c.trigger + ",")):
        body = f"{c.trigger}, {body}" if body else c.trigger
    return body, source


def _known(ctx, work: Path, key: str) -> tuple[dict[str, str], dict[str, str]]:
    """(captions this build's interrupted attempts generated, captions the previous version holds), by image
    content hash, for this generation key."""
    resumed = {r["sha256"]: r["caption"] for r in _complete_lines(work / GENERATED) if r.get("key") == key}
    previous: dict[str, str] = {}
    if ctx.force:  # trust nothing already built
        return resumed, previous
    # Every published version, oldest first so the newest wins: switching policy back and forth (missing ->
    # prefix) finds the captions any earlier version generated with this model and these settings.
    for path in ctx.store.versions("caption"):
        try:
            ctx.store.read(path, CaptionManifest)
        except ArtifactError as err:
            ctx.log.warning("caption: not reusing %s: %s", path, err)
            continue
        for r in read_jsonl(path / CAPTIONS):
            if r.get("generated_by") == key and r.get("model_caption") is not None:
                previous[r["sha256"]] = r["model_caption"]
    return resumed, previous


def _complete_lines(path: Path) -> list[dict]:
    """The rows of a log a kill may have cut mid-line (that last line is dropped)."""
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def build(ctx, work: Path, upstream: dict) -> dict:
    cfg, started = ctx.cfg, time.monotonic()
    scan: ScanManifest = upstream["scan"]
    scan_dir = ctx.store.version_dir("scan", scan.fingerprint)
    records = [ImageRecord.model_validate(r) for r in read_jsonl(scan_dir / "images.jsonl")]
    roots = scan.roots()
    items = plan(records, cfg, roots)
    identity = vlm.identity(ctx)
    key = generation_key(identity, cfg)
    resumed, previous = _known(ctx, work, key)
    captions = {**previous, **resumed}
    todo: dict[str, Item] = {}  # one generation per distinct image content
    for it in items:
        if it.needs_model and it.record.sha256 not in captions:
            todo.setdefault(it.record.sha256, it)
    arch = generate_missing(ctx, work, list(todo.values()), roots, key, captions)
    rows = []
    for it in items:
        model_caption = captions.get(it.record.sha256) if it.needs_model else None
        caption, source = combine(it, model_caption, cfg)
        rows.append(
            {
                "ref": it.record.ref,
                "path": it.record.path,
                "sha256": it.record.sha256,
                "caption": caption,
                "source": source,
                "user_caption": it.user,
                "model_caption": model_caption,
                "generated_by": key if it.needs_model else None,
            }
        )
    write_jsonl(work / CAPTIONS, rows)
    (work / GENERATED).unlink(missing_ok=True)
    wanted = {it.record.sha256 for it in items if it.needs_model}
    reused, resumed_now = wanted & set(previous), (wanted & set(resumed)) - set(previous)
    ctx.log.info(
        "caption: %d images, %d captioned now, %d resumed, %d reused, %d kept the user's caption",
        len(items),
        len(todo),
        len(resumed_now),
        len(reused),
        sum(not it.needs_model for it in items),
    )
    return {
        "model": cfg.caption.model,
        "model_identity": identity,
        "architecture": arch,
        "prompt": cfg.caption.prompt,
        "trigger": cfg.caption.trigger,
        "policy": cfg.caption.policy,
        "decoding": cfg.caption.decoding(),
        "images": len(items),
        "captioned": len(todo) + len(resumed_now),
        "reused": len(reused),
        "resumed": len(resumed_now),
        "user": sum(r["source"] == "user" for r in rows),
        "seconds": round(time.monotonic() - started, 3),
    }


def generate_missing(ctx, work: Path, todo: list[Item], roots: dict, key: str, captions: dict[str, str]) -> str:
    """Caption `todo` in batches of caption.batch_size, appending each batch to generated.jsonl as it completes.
    Returns the model's class name ("" when nothing needed the model, which is then never loaded)."""
    if not todo:
        return ""
    from tuneline.stages.scan.images import load_rgb
    from tuneline.stages.scan.members import open_image

    cfg = ctx.cfg.caption
    captioner = vlm.load(vlm.model_folder(ctx), cfg.prompt, cfg.device, cfg.dtype)
    bs, done = cfg.batch_size, 0
    with open(work / GENERATED, "a", encoding="utf-8") as log:
        for start in range(0, len(todo), bs):
            batch = todo[start : start + bs]
            images = [
                shrink(load_rgb(open_image(roots[it.record.source], it.record), it.record), cfg.image_size)
                for it in batch
            ]
            texts = captioner.generate(captioner.inputs(images), cfg.decoding(), cfg.seed + start)
            for it, text in zip(batch, texts):
                captions[it.record.sha256] = text
                log.write(json.dumps({"sha256": it.record.sha256, "key": key, "caption": text}) + "\n")
            log.flush()
            os.fsync(log.fileno())
            done += len(batch)
            ctx.reporter.progress("caption-progress", done / len(todo), "images captioned")
    return captioner.architecture


def shrink(image, longest: int):
    """The image with its longer edge at most `longest` pixels (bounds the vision tokens of dynamic-resolution
    processors; fixed-size processors resize anyway)."""
    if max(image.size) <= longest:
        return image
    scale = longest / max(image.size)
    return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
