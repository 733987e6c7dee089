"""The scan of a webdataset or parquet source: shards whose identity the last scan recorded are not read again.

The index of every shard (shardindex.py) is remembered beside the scan's versions, one file per source: a
scheduled run over a bucket where one shard landed lists the prefix, reads that one shard and reuses the rest.
A shard whose identity changed is read again; when its bytes did not change (a re-upload) it yields the same
records, so the scan's version stays. A killed scan keeps the shards it finished (`.progress`) and resumes after
them.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tuneline.schemas.scan import MEMBER_FIELDS, Rejected
from tuneline.schemas.sources import Source
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.stage import StageFailed
from tuneline.stages.scan.captions import Captions
from tuneline.stages.scan.controls import source_roots
from tuneline.stages.scan.images import Probe
from tuneline.stages.scan.listing import Listing
from tuneline.stages.scan.probecache import load_rows, save_rows
from tuneline.stages.scan.shardfs import ShardFile, detect, filesystem, list_shards
from tuneline.stages.scan.shardindex import ShardIndex, index_parquet, index_tar

# Shards are read whole and streamed: a few at once keep a network store busy while headers parse.
WORKERS = min(4, 2 * (os.cpu_count() or 1))
READ_KEY = "scan-shards-read"


class MemberCaptions(Captions):
    """Captions read from the shards themselves (`.txt` members as sidecars, `.json` fields and parquet columns
    as metadata); the missing / empty caption policy is the folder scan's."""

    def __init__(self, cfg, known: dict[str, list[str]]):
        super().__init__(Listing(Path(".")), cfg)
        self.sidecars = {p: t for p, (t, src) in known.items() if src == "sidecar"}
        self.metadata = {p: t for p, (t, src) in known.items() if src != "sidecar"}

    def _sidecar(self, rel: str) -> str | None:
        return self.sidecars.get(rel)


@dataclass
class Members:
    """A shard source as the scan's record loop takes it."""

    probes: list[Probe] = field(default_factory=list)
    captions: MemberCaptions | None = None
    problems: list[Rejected] = field(default_factory=list)
    reopened: int = 0
    fields: dict[str, dict] = field(default_factory=dict)  # image path -> shard, offset | row_group, row
    read: list[str] = field(default_factory=list)  # shards indexed now


def fingerprint(src: Source) -> dict:
    """The listing's fingerprint: shard names and identities (no shard is opened)."""
    shards = list_shards(src, detect(src))
    return {"dataset": src.location, "shards": len(shards), "listing": digest([(s.rel, s.identity) for s in shards])}


def _cache_path(ctx, src: Source) -> Path:
    """One index per source and per the settings that decide what an index holds."""
    d = ctx.cfg.dataset
    reads = [d.image_column, d.caption_column, src.caption_extension, d.metadata_caption_field, d.extensions]
    return ctx.store.stage_dir("scan") / f".shards-{digest([src.location, reads, code_version('scan')])}.jsonl"


def _load(ctx, src: Source) -> dict[str, ShardIndex]:
    indexes = load_rows(ctx, _cache_path(ctx, src), lambda row: ShardIndex(**row), "every shard is read")
    return {i.rel: i for i in indexes}


def scan_source(ctx, src: Source, *, save: bool) -> Members:
    """Every member's probe and caption; shards with the recorded identity come from the saved index."""
    fmt = detect(src)
    _folders_only(ctx.cfg, src, fmt)
    shards = list_shards(src, fmt)
    progress = _cache_path(ctx, src).with_suffix(".progress")
    previous = _load(ctx, src) | _resumed(progress)
    todo = [s for s in shards if previous.get(s.rel) is None or previous[s.rel].identity != s.identity]
    fresh = _index_all(ctx, src, fmt, todo, progress if save else None)
    indexes = [fresh.get(s.rel) or previous[s.rel] for s in shards]
    if save:
        save_rows(_cache_path(ctx, src), [i.as_json() for i in indexes])
        progress.unlink(missing_ok=True)
    out = Members(read=[s.rel for s in todo])
    known: dict[str, list[str]] = {}
    for shard, index in zip(shards, indexes, strict=True):
        known |= index.captions
        out.problems += [Rejected(**p) for p in index.problems]
        for m in index.members:
            out.fields[m["path"]] = {k: m[k] for k in MEMBER_FIELDS if k in m} | {"shard": shard.rel}
            out.probes.append(Probe(**{k: v for k, v in m.items() if k not in (*MEMBER_FIELDS, "key")}))
    out.reopened = sum(len(fresh[s.rel].members) for s in todo)
    out.captions = MemberCaptions(
        ctx.cfg.dataset.model_copy(update={"caption_extension": src.caption_extension}), known
    )
    if save:  # what this build read, for its manifest (a status check's dry scan is not a build)
        ctx.cache.setdefault(READ_KEY, []).extend(out.read)
    return out


def _folders_only(cfg, src: Source, fmt: str) -> None:
    """Masks and controls are matched to images as files beside them; shards and tables have none."""
    control, field = source_roots(cfg)[src.index]
    used = (["dataset.masks"] if cfg.dataset.masks else []) + ([field] if control is not None else [])
    if used:
        raise StageFailed(
            f"{src.field} {src.location} is a {fmt} source, and {' and '.join(used)} apply only to folders of "
            f"image files: set {' and '.join(used)} to null, or unpack the source into a folder"
        )


def _resumed(progress: Path) -> dict[str, ShardIndex]:
    """Shards a killed scan finished indexing (one JSON line each, appended as each finished); a line cut by the
    kill ends what is kept."""
    out: dict[str, ShardIndex] = {}
    try:
        with open(progress, "rb") as f:
            for line in f:
                index = ShardIndex(**json.loads(line))
                out[index.rel] = index
    except (FileNotFoundError, ValueError, TypeError):  # none yet, or the line the kill cut
        pass
    return out


def _index_all(ctx, src: Source, fmt: str, todo: list[ShardFile], progress: Path | None) -> dict[str, ShardIndex]:
    """Index the shards; each finished one is appended to `progress` at once, so a killed scan resumes after it."""
    fs, _ = filesystem(src.location, src.storage_options)
    cfg = ctx.cfg.dataset.model_copy(update={"caption_extension": src.caption_extension})
    reported, done, out = time.monotonic(), 0, {}

    def one(shard: ShardFile) -> ShardIndex:
        return index_tar(fs, shard, cfg) if fmt == "webdataset" else index_parquet(fs, shard, cfg)

    with ThreadPoolExecutor(WORKERS) as pool:
        for index in pool.map(one, todo):
            out[index.rel] = index
            if progress is not None:
                with open(progress, "ab") as f:
                    f.write(json.dumps(index.as_json()).encode() + b"\n")
            done += 1
            if done == len(todo) or time.monotonic() - reported >= 0.5:
                reported = time.monotonic()
                ctx.reporter.progress(
                    "scan-progress", done / len(todo), f"{done}/{len(todo)} new or changed shards read"
                )
    return out
