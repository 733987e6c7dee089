"""Encode each unique caption once with the family's text encoders and store every tensor it returns."""
from __future__ import annotations

from pathlib import Path

import torch
import zarr

from schemas.scan import ScanManifest
from stages.common import models
from stages.common.jsonl import read_jsonl, write_jsonl
from stages.text.store import CAPTIONS, STORE


def unique_captions(scan_dir: Path) -> list[str]:
    """The empty caption first (row 0), then each distinct caption in first-seen order."""
    seen = {"": None}
    for r in read_jsonl(scan_dir / "images.jsonl"):
        seen.setdefault(r["caption"], None)
    return list(seen)


def build(ctx, work: Path, upstream: dict) -> dict:
    cfg = ctx.cfg
    scan: ScanManifest = upstream["scan"]
    captions = unique_captions(models.artifact_dir(ctx, scan))
    fam = models.family(cfg)
    dev = models.device(cfg)
    enc = fam.load_text_encoders(models.model_dir(ctx), models.dtype(cfg, dev), dev, max_length=cfg.text.max_length)
    group = zarr.open_group(str(work / STORE), mode="w")
    fields: dict[str, dict] = {}
    bs = cfg.text.batch_size
    for start in range(0, len(captions), bs):
        with torch.no_grad():
            out = fam.encode_text(enc, captions[start:start + bs])
        for name, t in out.items():
            t = t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype)
            if t.is_floating_point():
                t = t.to(getattr(torch, cfg.text.dtype))
            if name not in group:
                dt = str(t.dtype).removeprefix("torch.")
                group.create_array(name, shape=(len(captions), *t.shape[1:]), chunks=(bs, *t.shape[1:]), dtype=dt)
                fields[name] = {"shape": tuple(t.shape[1:]), "dtype": dt}
            if tuple(t.shape[1:]) != tuple(fields[name]["shape"]):
                raise RuntimeError(f"text encoder output {name} changed shape mid-run: {tuple(t.shape[1:])} vs "
                                   f"{fields[name]['shape']} (caption {captions[start]!r})")
            group[name][start:start + len(t)] = t.numpy()
        ctx.reporter.progress("text-progress", min(1.0, (start + bs) / len(captions)), "captions encoded")
    write_jsonl(work / CAPTIONS, ({"row": i, "caption": c} for i, c in enumerate(captions)))
    return {"family": fam.facts.name, "encoder_identity": models.identity(ctx, "text"),
            "max_length": enc.max_length, "fields": fields, "count": len(captions)}
