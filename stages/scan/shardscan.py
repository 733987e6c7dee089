"""The scan of a webdataset or parquet source: shards whose identity the last scan recorded are not read again.

The index of every shard (shardindex.py) is remembered beside the scan's versions, one file per shard: a
scheduled run over a bucket where one shard landed lists the prefix, reads that one shard and reuses the rest.
A shard whose identity changed is read again; when its bytes did not change (a re-upload) it yields the same
records, so the scan's version stays. A killed scan keeps the shards it finished and resumes after them, inside a
long shard (its members so far) or table (its row groups so far) where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tuneline.schemas.scan import MEMBER_FIELDS, MEMBERS, Rejected
from tuneline.schemas.sources import Source, dataset_sources
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.stage import StageFailed
from tuneline.stages.common.staleness import diff
from tuneline.stages.scan import samples
from tuneline.stages.scan.captions import Captions
from tuneline.stages.scan.controls import source_roots
from tuneline.stages.scan.images import Probe
from tuneline.stages.scan.listing import Listing
from tuneline.stages.scan.masks import ALPHA
from tuneline.stages.scan.shardfs import ShardFile, detect, filesystem, list_shards
from tuneline.stages.scan.shardindex import Progress, ShardIndex, index_parquet, index_tar

# Shards are read whole and streamed: a few at once keep a network store busy while headers parse.
WORKERS = min(4, 2 * (os.cpu_count() or 1))
READ_KEY = "scan-shards-read"
LISTED_KEY = "scan-shards-listed"
NAMED = 3  # shards named per kind of change in a status reason


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
    parts: dict[str, dict] = field(default_factory=dict)  # image path -> its mask / control member (samples.py)
    read: list[str] = field(default_factory=list)  # shards indexed now


def fingerprint(src: Source) -> dict:
    """The listing's fingerprint: shard names and identities (no shard is opened)."""
    shards = list_shards(src, detect(src))
    return {"dataset": src.location, "shards": len(shards), "listing": digest([(s.rel, s.identity) for s in shards])}


def index_dir(ctx, src: Source) -> Path:
    """One folder per source and per the settings that decide what an index holds; a file per shard in it."""
    d = ctx.cfg.dataset
    reads = [d.image_column, d.caption_column, src.caption_extension, d.metadata_caption_field, d.extensions]
    # Indexes kept before samples' mask / control members were recorded lack them: read again where they are used.
    reads += ["members"] if samples.used(ctx.cfg, src) else []
    return ctx.store.stage_dir("scan") / f".shards-{digest([src.location, reads, code_version('scan')])}"


def kept_file(folder: Path, shard: ShardFile) -> Path:
    return folder / f"{digest(shard.rel)}.json"


def progress_file(folder: Path, shard: ShardFile) -> Path:
    """How far an unfinished pass over the shard got (shardindex.Progress); pruned with the rest when it ends."""
    return folder / f"{digest(shard.rel)}.progress.json"


def load_kept(ctx, path: Path, identity: str) -> dict | None:
    """A shard's kept JSON object when it describes this identity; anything unreadable means the shard is read."""
    try:
        row = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        ctx.log.warning("scan: ignoring the cache %s (%s); its shard is read again", path, err)
        return None
    return row if isinstance(row, dict) and row.get("identity") == identity else None


def save_kept(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # atomic: a killed scan leaves whole files only


def prune(folder: Path, shards: list[ShardFile]) -> None:
    """Drop what is kept for shards no longer listed (removed from the source), so a bucket's churn does not pile up."""
    keep = {kept_file(folder, s).name for s in shards}
    for path in folder.glob("*.json"):
        if path.name not in keep:
            path.unlink(missing_ok=True)


def keeps(ctx, save: bool) -> bool:
    """Whether a scan keeps what it reads: a build does; a status check's dry scan does where a scan ran before (the
    next check and the build then read nothing again), and creates no workdir."""
    return save or ctx.store.stage_dir("scan").is_dir()


def shard_indexes(
    ctx, src: Source, fmt: str, shards: list[ShardFile], *, keep: bool
) -> tuple[list[ShardIndex], list[str]]:
    """Each shard's index, and the shards read now: with `keep`, an index is kept as soon as its shard is read (a
    killed scan resumes after the shards it finished)."""
    folder = index_dir(ctx, src)
    previous = {}
    for s in shards:
        if (row := load_kept(ctx, kept_file(folder, s), s.identity)) is not None:
            try:
                previous[s.rel] = ShardIndex(**row)
            except TypeError as err:
                ctx.log.warning("scan: ignoring the cache of shard %s (%s); it is read again", s.name, err)
    todo = [s for s in shards if s.rel not in previous]
    fresh = _index_all(ctx, src, fmt, todo, folder if keep else None)
    return [fresh.get(s.rel) or previous[s.rel] for s in shards], [s.rel for s in todo]


def members(ctx, src: Source, pairs: list[tuple[ShardFile, ShardIndex]]) -> Members:
    """The scan's view of these shards' members: probes, captions, problems, where each image is."""
    out = Members()
    known: dict[str, list[str]] = {}
    for shard, index in pairs:
        known |= index.captions
        out.parts |= index.parts
        out.problems += [Rejected(**p) for p in index.problems]
        for m in index.members:
            out.fields[m["path"]] = {k: m[k] for k in MEMBER_FIELDS if k in m} | {"shard": shard.rel}
            out.probes.append(Probe(**{k: v for k, v in m.items() if k not in (*MEMBER_FIELDS, "key")}))
    out.captions = MemberCaptions(
        ctx.cfg.dataset.model_copy(update={"caption_extension": src.caption_extension}), known
    )
    return out


def reopened(indexes: list[ShardIndex], read: list[str]) -> int:
    """Images read now: the members of the shards read, but for those a killed pass had read."""
    return sum(len(i.members) - i.resumed for i in indexes if i.rel in set(read))


def listed(ctx, src: Source) -> tuple[str, list[ShardFile]]:
    """The source's format and shards (mask and control folders refused: they are matched to files beside images;
    a webdataset sample's own members are not)."""
    fmt = detect(src)
    _folders_only(ctx.cfg, src, fmt)
    samples.check(ctx.cfg, src, fmt)
    return fmt, list_shards(src, fmt)


def scan_source(ctx, src: Source, *, save: bool) -> Members:
    """Every member's probe and caption; shards with the recorded identity come from their kept index."""
    fmt, shards = listed(ctx, src)
    indexes, read = shard_indexes(ctx, src, fmt, shards, keep=keeps(ctx, save))
    out = members(ctx, src, list(zip(shards, indexes, strict=True)))
    out.read = read
    out.reopened = reopened(indexes, read)
    if save:  # what this build read, for its manifest (a status check's dry scan is not a build)
        ctx.cache.setdefault(READ_KEY, []).extend(read)
        prune(index_dir(ctx, src), shards)
        record_listing(ctx, src, {s.rel: [s.identity, i.content()] for s, i in zip(shards, indexes, strict=True)})
    return out


def record_listing(ctx, src: Source, listing: dict[str, list[str]]) -> None:
    """The build's shards with their identity and content, for its manifest's shard_listing (see explain)."""
    ctx.cache.setdefault(LISTED_KEY, {})[src.location] = listing


def explain(ctx, manifest, inputs: dict) -> list[str] | None:
    """The scan's input changes since a published version (`tuneline status`): the shards added, replaced and
    removed by name, then any other input that changed. None where that version recorded no shards."""
    before = manifest.shard_listing
    lines = []
    for src in dataset_sources(ctx.cfg):
        if src.location not in before:
            continue
        try:
            now = list_shards(src, detect(src))
        except (StageFailed, OSError):  # a store that cannot be listed now: status shows the inputs' difference
            return None
        lines += _shard_changes(src.location, before[src.location], _contents(ctx, src, before[src.location], now))
    if not lines:
        return None
    return lines + [f"input {c}" for c in diff(_unlisted(manifest.inputs), _unlisted(inputs), "")]


def _contents(ctx, src: Source, before: dict[str, list[str]], now: list[ShardFile]) -> dict[str, str]:
    """Each listed shard's content digest: the recorded one while its identity holds, else its kept index's (the
    status check's dry scan has just indexed it), else its new identity."""
    out = {}
    for s in now:
        if s.rel in before and before[s.rel][0] == s.identity:
            out[s.rel] = before[s.rel][1]
        elif (row := load_kept(ctx, kept_file(index_dir(ctx, src), s), s.identity)) is not None:
            out[s.rel] = ShardIndex(**row).content()
        else:
            out[s.rel] = s.identity
    return out


def _shard_changes(location: str, before: dict[str, list[str]], now: dict[str, str]) -> list[str]:
    kinds = {
        "added": sorted(now.keys() - before.keys()),
        "replaced": sorted(r for r in now.keys() & before.keys() if now[r] != before[r][1]),
        "removed": sorted(before.keys() - now.keys()),
    }
    out = []
    for kind, rels in kinds.items():
        if rels:
            more = f" and {len(rels) - NAMED} more" if len(rels) > NAMED else ""
            out.append(f"shards {kind} in {location}: {', '.join(r or location for r in rels[:NAMED])}{more}")
    return out


def _unlisted(inputs: dict) -> dict:
    """The inputs without the shard listings' fingerprints (named shard by shard instead)."""

    def strip(d):
        return {k: v for k, v in d.items() if k not in ("shards", "listing")} if isinstance(d, dict) else d

    out = strip(inputs)
    return out | ({"sources": [strip(s) for s in out["sources"]]} if "sources" in out else {})


def _folders_only(cfg, src: Source, fmt: str) -> None:
    """Mask and control folders are matched to images as files beside them; shards and tables have none (alpha
    masks are the images' own alpha channel, read from the members; `members`: the samples' own members)."""
    control, field = source_roots(cfg)[src.index]
    folder_masks = cfg.dataset.masks not in (None, ALPHA, MEMBERS)
    used = (["dataset.masks"] if folder_masks else []) + ([field] if control is not None else [])
    if used:
        raise StageFailed(
            f"{src.field} {src.location} is a {fmt} source, and {' and '.join(used)} apply only to folders of "
            f"image files: set {' and '.join(used)} to members (a webdataset sample's key.mask.<ext> / "
            f"key.control.<ext> members) or null (dataset.masks may be alpha), or unpack the source into a folder"
        )


def _index_all(ctx, src: Source, fmt: str, todo: list[ShardFile], folder: Path | None) -> dict[str, ShardIndex]:
    """Index the shards; each finished one is kept at once, so a killed scan resumes after it."""
    fs, _ = filesystem(src.location, src.storage_options)
    cfg = ctx.cfg.dataset.model_copy(update={"caption_extension": src.caption_extension})
    reported, done, out = time.monotonic(), 0, {}

    reader = index_tar if fmt == "webdataset" else index_parquet

    def one(shard: ShardFile) -> ShardIndex:
        if folder is None:
            return reader(fs, shard, cfg)
        partial = progress_file(folder, shard)
        row = load_kept(ctx, partial, shard.identity)
        resume = Progress(**row) if row is not None else None
        return reader(fs, shard, cfg, resume, lambda p: save_kept(partial, json.dumps(p.as_json()).encode()))

    with ThreadPoolExecutor(WORKERS) as pool:
        for shard, index in zip(todo, pool.map(one, todo), strict=True):
            out[index.rel] = index
            if folder is not None:
                save_kept(kept_file(folder, shard), json.dumps(index.as_json(), ensure_ascii=False).encode())
                progress_file(folder, shard).unlink(missing_ok=True)
            done += 1
            if done == len(todo) or time.monotonic() - reported >= 0.5:
                reported = time.monotonic()
                ctx.reporter.progress(
                    "scan-progress", done / len(todo), f"{done}/{len(todo)} new or changed shards read"
                )
    return out
