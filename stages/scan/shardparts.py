"""A shard's finished scan output, kept and reused whole: a rescan after one shard landed builds that shard's
records only, and reads no byte of the other shards' records.

Per shard, keyed by its identity and by everything that shapes its records (the scan's stage config and the
family's facts: `recipe`; the scan's recorded code version and source), the scan keeps the shard's `images.jsonl`
lines, the digest of its records' canonical JSON, their content hashes, bucket counts and rejections. A part is one
file: its facts as a JSON line, its image names as a JSON line (read only when a content hash repeats), then the
lines. The scan's output is the kept parts in order: the facts parsed, the lines copied into images.jsonl by the
kernel, and the content digest taken over the parts' digests, so what a rescan costs grows with the shards, not
the images. A cold scan goes the same way, so cold and incremental scans publish the same bytes and the same
version. When the whole dataset changes records (duplicates rejected, a bucket dropped, parts whose paths
interleave) the scan builds every record as for folders (`None` here).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

from tuneline.schemas.scan import BucketRow, ImageRecord, Rejected
from tuneline.schemas.sources import Source
from tuneline.stages.common.codeident import recorded
from tuneline.stages.common.hashing import canonical_json, digest
from tuneline.stages.scan import buckets as bk, controls, shardscan
from tuneline.stages.scan.shardfs import ShardFile, is_container


@dataclass
class Part:
    """A shard's finished output: its facts (`head`), its image names (JSON, one per hash in head["shas"]) and
    its images.jsonl lines, in memory for a part built now or as (file, offset, length) for a kept one."""

    head: dict
    refs: bytes
    lines: bytes = b""
    kept: tuple[Path, int, int] | None = None

    def dump(self) -> bytes:
        return json.dumps(self.head, ensure_ascii=False).encode() + b"\n" + self.refs + b"\n" + self.lines

    def copy_to(self, out) -> None:
        """Append the lines to `out`, an unbuffered binary file: a kept part's without passing them through Python."""
        if self.kept is None:
            _write(out, self.lines)
            return
        path, offset, length = self.kept
        kernel = getattr(os, "copy_file_range", None)  # Linux only
        with open(path, "rb") as f:
            while length:
                try:
                    n = kernel(f.fileno(), out.fileno(), length, offset) if kernel else 0
                except OSError:  # a filesystem or kernel without it (EXDEV, ENOSYS): copy through memory
                    n = 0
                if not n:  # none, or a kernel/filesystem pair that copies nothing: through memory
                    kernel = None
                    f.seek(offset)
                    n = _write(out, f.read(length))
                if not n:
                    raise OSError(f"{path} ended before its {length} bytes of records")
                offset, length = offset + n, length - n


@dataclass
class Finished:
    """What the scan publishes, assembled from the kept parts."""

    parts: list[Part]  # in the published order
    content: str  # the content digest: over the parts' digests of their records' canonical JSON
    accepted: int
    conversions: dict[str, int]
    rejected: list[Rejected] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    rows: list[BucketRow] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)
    reopened: int = 0

    def write(self, path: Path) -> int:
        """images.jsonl; returns the number of records."""
        with open(path, "wb", buffering=0) as out:
            for p in self.parts:
                p.copy_to(out)
        return self.accepted


def _write(out, data: bytes) -> int:
    """All of `data` into an unbuffered file, which may take it in several writes."""
    view = memoryview(data)
    while view:
        view = view[out.write(view) :]
    return len(data)


def load_part(ctx, path: Path, identity: str) -> Part | None:
    """The kept part when it describes this identity (its lines stay on disk); anything unreadable means the
    shard's records are built."""
    try:
        with open(path, "rb") as f:
            head = json.loads(f.readline())
            refs = f.readline().rstrip(b"\n")
            offset, size = f.tell(), os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        ctx.log.warning("scan: ignoring the cache %s (%s); its shard's records are built again", path, err)
        return None
    if not isinstance(head, dict) or head.get("identity") != identity:
        return None
    return Part(head, refs, kept=(path, offset, size - offset))


def part(shard: ShardFile, records: list[ImageRecord], rejected: list[Rejected], content: str) -> Part:
    """A shard's finished output, its records in the order the published list has them (by name, stable over
    buckets: bk.apply_plan's order restricted to this shard)."""
    ordered = sorted((r for rs in bk.by_bucket(records).values() for r in rs), key=lambda r: r.ref)
    dumps = [r.model_dump(mode="json") for r in ordered]
    lines = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in dumps)
    canonical = ",".join(canonical_json(controls.consumed(r, d)) for r, d in zip(ordered, dumps, strict=True))
    pairs = dict.fromkeys((r.sha256, r.ref) for r in records)
    head = {
        "rel": shard.rel,
        "identity": shard.identity,
        "content": content,  # the shard index's (shardindex.ShardIndex.content): status names a replaced shard
        "span": [ordered[0].ref, ordered[-1].ref] if ordered else None,
        "images": len({r.path for r in records}),
        "digest": hashlib.sha256(canonical.encode()).hexdigest(),
        "shas": "".join(sha for sha, _ in pairs),  # once per (content hash, name), one string: parsed at C speed
        "buckets": [[list(b), len(rs), [r.ref for r in rs[: bk.SAMPLES]]] for b, rs in bk.by_bucket(records).items()],
        "conversions": dict(Counter(r.conversion for r in records if r.conversion)),
        "rejected": [r.model_dump() for r in rejected],
    }
    refs = json.dumps([ref for _, ref in pairs], ensure_ascii=False).encode()
    return Part(head, refs, lines.encode())


def _parts(ctx, src: Source, recipe, build, save: bool) -> tuple[list[Part], int]:
    """The source's parts in listing order (missing ones built and kept), and how many members were read."""
    fmt, shards = shardscan.listed(ctx, src)
    # The recorded source too: a part's layout may change with the code while the scan's version does not.
    folder = ctx.store.stage_dir("scan") / f".parts-{digest([src.location, src.index, recipe, recorded()['scan']])}"
    kept = {s.rel: load_part(ctx, shardscan.kept_file(folder, s), s.identity) for s in shards}
    missing = [s for s in shards if kept[s.rel] is None]
    keep = shardscan.keeps(ctx, save)
    indexes, read = shardscan.shard_indexes(ctx, src, fmt, missing, keep=keep)
    for shard, index in zip(missing, indexes, strict=True):
        got = shardscan.members(ctx, src, [(shard, index)])
        records, rejected = build(src, got)
        kept[shard.rel] = part(shard, records, rejected, index.content())
        if keep:
            shardscan.save_kept(shardscan.kept_file(folder, shard), kept[shard.rel].dump())
    if save:  # what this build read, for its manifest (a status check's dry scan is not a build)
        ctx.cache.setdefault(shardscan.READ_KEY, []).extend(read)
        shardscan.record_listing(ctx, src, {s.rel: [s.identity, kept[s.rel].head["content"]] for s in shards})
        shardscan.prune(folder, shards)
        shardscan.prune(shardscan.index_dir(ctx, src), shards)
    return [kept[s.rel] for s in shards], shardscan.reopened(indexes, read)


def finished(ctx, sources: list[Source], recipe, build, *, save: bool) -> Finished | None:
    """The scan of shard sources from kept parts; None where the dataset as a whole changes records."""
    cfg = ctx.cfg
    if not sources or not all(is_container(s) for s in sources) or controls.paired(cfg):
        return None
    parts, out = [], Finished(parts=[], content="", accepted=0, conversions={})
    for src in sources:
        got, reopened = _parts(ctx, src, recipe, build, save)
        parts += got
        out.reopened += reopened
        out.sources.append({"root": src.location, "role": src.role, "images": sum(p.head["images"] for p in got)})
    if len(sources) > 1 and any(not s["images"] for s in out.sources):
        return None  # the record-by-record scan names the empty source
    out.groups = _groups(parts)
    if out.groups and cfg.dataset.duplicates == "reject":
        return None
    counts, samples = _buckets(parts)
    batch = cfg.train.global_batch()
    try:
        out.plan = bk.bucket_plan(counts, batch, cfg.buckets.small_bucket)
    except bk.NoBatchError:
        return None  # the record-by-record scan reports it with the rejections
    if not all(out.plan.values()):
        return None  # a dropped bucket's records are rejected: the record-by-record scan names each
    ordered = sorted((p for p in parts if p.head["span"]), key=lambda p: p.head["span"][0])
    if not all(a.head["span"][1] < b.head["span"][0] for a, b in zip(ordered, ordered[1:])):
        return None  # parts whose names interleave: the published order is not theirs one after another
    out.rows = [
        BucketRow(width=b[0], height=b[1], frames=b[2] if len(b) > 2 else None, count=n, samples=samples[b])
        for b, n in sorted(counts.items())
    ]
    out.parts = ordered
    out.content = digest({"parts": [p.head["digest"] for p in ordered]})
    out.accepted = sum(counts.values())
    conversions = sum((Counter(p.head["conversions"]) for p in parts), Counter())
    out.conversions = dict(sorted(conversions.items()))
    out.rejected = sorted((Rejected(**r) for p in parts for r in p.head["rejected"]), key=lambda r: r.path)
    return out


def _groups(parts: list[Part]) -> list[list[str]]:
    """Identical-content groups across every part (bk.duplicate_groups over the records)."""
    digests = [bytes.fromhex(p.head["shas"]) for p in parts]
    firsts: set[int] = set()  # each hash's first 8 bytes, taken at C speed: all distinct, no two images are alike
    for d in digests:
        firsts.update(memoryview(d).cast("Q")[::4])
    if len(firsts) == sum(len(d) for d in digests) // 32:  # the common case: no image name is parsed
        return []
    shas = [d[i : i + 32].hex() for d in digests for i in range(0, len(d), 32)]
    groups: dict[str, set[str]] = defaultdict(set)
    for sha, ref in zip(shas, chain.from_iterable(json.loads(p.refs) for p in parts), strict=True):
        groups[sha].add(ref)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def _buckets(parts: list[Part]) -> tuple[dict[tuple, int], dict[tuple, list[str]]]:
    """Bucket counts and each bucket's first samples in the scan's record order (sources, shards, members)."""
    counts: dict[tuple, int] = Counter()
    samples: dict[tuple, list[str]] = defaultdict(list)
    for p in parts:
        for b, n, first in p.head["buckets"]:
            counts[tuple(b)] += n
            samples[tuple(b)] = (samples[tuple(b)] + first)[: bk.SAMPLES]
    return dict(counts), samples
