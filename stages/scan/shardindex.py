"""One streaming pass over a shard: where each image is, its content hash, its header, its caption.

WebDataset (`000123.tar`): members are grouped by key (the member name up to the first '.' of its base name);
`key.<image ext>` is the image, `key.txt` (dataset.caption_extension) its caption, else a field of `key.json`
(dataset.metadata_caption_field, or the first of text / caption / prompt); `key.mask.<ext>` and `key.control.<ext>`
its mask and control members (stages/scan/samples.py). Each image's (and mask's, control's) data offset and size
are recorded, so later stages read it by byte range. Parquet (as pyarrow or Hugging Face `datasets` write it): the
image column holds bytes or {bytes, path} structs, read one row group at a time.
Nothing is extracted to disk; one member (or one row group) is in memory at a time.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import tarfile
import time
from dataclasses import dataclass, field

from tuneline.schemas.scan import DatasetConfig, Rejected
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.stage import StageFailed
from tuneline.stages.scan import samples
from tuneline.stages.scan.captions import AUTO_FIELDS
from tuneline.stages.scan.images import probe_bytes
from tuneline.stages.scan.shardfs import ShardFile

BLOCK = 512  # a tar archive's unit: headers and padded member data
END_BLOCKS = 2 * BLOCK  # a tar archive ends with two zero blocks
CHECKPOINT_S = 5.0


@dataclass
class ShardIndex:
    """What the scan knows of one shard; saved between scans and reused while the shard's identity holds."""

    rel: str
    identity: str
    sha256: str = ""  # the whole shard's (webdataset, read in one pass); parquet rows carry their own hashes
    members: list[dict] = field(default_factory=list)  # a Probe's fields + offset | row_group, row
    captions: dict[str, list[str]] = field(default_factory=dict)  # image path -> [text, source]
    problems: list[dict] = field(default_factory=list)  # Rejected rows
    parts: dict[str, dict] = field(default_factory=dict)  # image path -> its mask / control member (samples.py)
    resumed: int = 0  # members found by an earlier, killed pass (not read by this one)

    def as_json(self) -> dict:
        return dict(self.__dict__)

    def content(self) -> str:
        """What the scan takes from the shard (a shard rewritten with the same samples keeps it)."""
        return digest([self.members, self.captions, self.parts, self.problems])


def member_path(shard: str, name: str) -> str:
    """A member's record path: inside its shard, relative to the source."""
    return f"{shard}/{name}" if shard else name


class _Hashing:
    """A file object that hashes what is read through it: the shard's hash costs no second pass."""

    def __init__(self, f):
        self.f, self.sha, self.tail = f, hashlib.sha256(), b""

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.sha.update(data)
        self.tail = (self.tail + data)[-END_BLOCKS:]
        return data

    def ended(self) -> bool:
        """Whether the stream ended with tar's end-of-archive blocks (a shard cut between members has none)."""
        return len(self.tail) == END_BLOCKS and not self.tail.strip(b"\0")


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's (key, extension): 'a/b.seg.png' -> ('a/b', 'seg.png')."""
    folder, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(folder, stem), ext.lower()


@dataclass
class Progress:
    """How far a pass over a shard got: what it found so far and where the next member's header starts. Kept
    every CHECKPOINT_S while a long shard is read, so a killed scan resumes inside it."""

    rel: str
    identity: str
    at: int = 0  # byte offset of the next member's header (parquet: the next row group)
    members: list[dict] = field(default_factory=list)
    texts: dict[str, list[str]] = field(default_factory=dict)  # key (parquet: image path) -> [text, source]
    parts: dict[str, dict] = field(default_factory=dict)  # key -> {mask | control: the member's facts}
    problems: list[dict] = field(default_factory=list)
    last: str | None = None  # the last member read

    def as_json(self) -> dict:
        return dict(self.__dict__)


def index_tar(fs, shard: ShardFile, cfg: DatasetConfig, resume: Progress | None = None, keep=None) -> ShardIndex:
    """One streaming pass over a webdataset shard, from where `resume` stopped; `keep(progress)` is called every
    CHECKPOINT_S with how far it got."""
    p = resume if resume is not None and resume.identity == shard.identity else Progress(shard.rel, shard.identity)
    out = ShardIndex(shard.rel, shard.identity, members=p.members, problems=p.problems, resumed=len(p.members))
    images = {e.lower().lstrip(".") for e in cfg.extensions}
    base, kept = p.at, time.monotonic()
    with fs.open(shard.path, "rb") as raw:
        raw.seek(base)
        stream = _Hashing(raw)
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tf:
                for ti in tf:
                    if not ti.isfile() or posixpath.basename(ti.name).startswith("."):
                        continue
                    p.last = ti.name
                    _member(out, p, shard, ti, tf.extractfile(ti).read(), base + ti.offset_data, images, cfg)
                    p.at = base + ti.offset_data + -(-ti.size // BLOCK) * BLOCK
                    if keep is not None and time.monotonic() - kept >= CHECKPOINT_S:
                        keep(p)
                        kept = time.monotonic()
            stream.read()  # the shard's hash covers its padding too
            if not stream.ended():
                raise tarfile.ReadError("no end-of-archive blocks")
        except OSError as err:  # the store failed, not the shard: keep nothing of it (a rerun reads it again)
            raise StageFailed(
                f"reading shard {shard.name} failed ({type(err).__name__}: {err}): check the storage's address and "
                "credentials (dataset.storage_options, TUNELINE_REMOTE_OPTIONS) and rerun `tuneline stage scan`"
            ) from err
        except (tarfile.TarError, EOFError) as err:
            where = f"after member {p.last}" if p.last else "at its start"
            out.problems.append(
                _problem(
                    shard.name,
                    "truncated",
                    f"the shard breaks {where} ({type(err).__name__}: {err}): an interrupted "
                    f"upload or copy; re-copy the shard (the members before the break are used)",
                )
            )
    out.captions = {m["path"]: list(p.texts[m["key"]]) for m in out.members if m["key"] in p.texts}
    out.parts = {m["path"]: p.parts[m["key"]] for m in out.members if m["key"] in p.parts}
    out.sha256 = "" if base else stream.sha.hexdigest()
    return out


def _member(out: ShardIndex, p: Progress, shard: ShardFile, ti, data: bytes, offset: int, images, cfg) -> None:
    """One member: an image's probe and where its bytes are, or a caption of the key."""
    key, ext = split_key(ti.name)
    if ext in images:
        probe = probe_bytes(data, member_path(shard.rel, ti.name)).as_json()
        out.members.append(probe | {"offset": offset, "key": key})
    elif ext == cfg.caption_extension.lower().lstrip("."):
        p.texts[key] = [_text(out, shard, ti.name, data), "sidecar"]
    elif ext == "json":
        p.texts.setdefault(key, [_json_caption(out, shard, ti.name, data, cfg), "metadata"])
    elif (role := samples.role(ext, images)) is not None:
        p.parts.setdefault(key, {})[role] = samples.facts(probe_bytes(data, member_path(shard.rel, ti.name)), offset)


def _problem(path: str, kind: str, reason: str) -> dict:
    return Rejected(path=path, kind=kind, reason=reason).model_dump()


def _text(out: ShardIndex, shard: ShardFile, name: str, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        out.problems.append(
            _problem(
                member_path(shard.rel, name),
                "caption",
                f"caption member is not UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}): "
                f"re-write it as UTF-8 in the shard",
            )
        )
        return ""


def _json_caption(out: ShardIndex, shard: ShardFile, name: str, data: bytes, cfg: DatasetConfig) -> str:
    fields = [cfg.metadata_caption_field] if cfg.metadata_caption_field else list(AUTO_FIELDS)
    try:
        row = json.loads(data)
    except ValueError as err:
        out.problems.append(
            _problem(member_path(shard.rel, name), "caption", f"not valid JSON ({err}): fix the member")
        )
        return ""
    value = next((row[f] for f in fields if isinstance(row, dict) and isinstance(row.get(f), str)), "")
    return value


def index_parquet(fs, shard: ShardFile, cfg: DatasetConfig, resume: Progress | None = None, keep=None) -> ShardIndex:
    """One pass over a parquet table's row groups, from the one `resume` stopped at (those before it are not read
    again); `keep(progress)` is called every CHECKPOINT_S with how far it got."""
    import pyarrow.parquet as pq

    p = resume if resume is not None and resume.identity == shard.identity else Progress(shard.rel, shard.identity)
    out = ShardIndex(shard.rel, shard.identity, members=p.members, problems=p.problems, resumed=len(p.members))
    kept = time.monotonic()
    with fs.open(shard.path, "rb") as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if cfg.image_column not in names:
            out.problems.append(
                _problem(
                    shard.name,
                    "parquet",
                    f"no column {cfg.image_column!r} (columns: {', '.join(names)}): set dataset.image_column "
                    f"to the column holding the images",
                )
            )
            return out
        columns = [cfg.image_column] + ([cfg.caption_column] if cfg.caption_column in names else [])
        for rg in range(p.at, pf.num_row_groups):  # p.at: the next row group to read
            table = pf.read_row_group(rg, columns=columns)
            cells = table.column(cfg.image_column).to_pylist()
            texts = table.column(cfg.caption_column).to_pylist() if len(columns) > 1 else [None] * len(cells)
            for row, (cell, text) in enumerate(zip(cells, texts, strict=True)):
                _parquet_row(out, p, shard, (rg, row), cell, text, cfg)
            p.at = rg + 1
            if keep is not None and time.monotonic() - kept >= CHECKPOINT_S:
                keep(p)
                kept = time.monotonic()
    out.captions = {name: list(text) for name, text in p.texts.items()}
    return out


def _parquet_row(out: ShardIndex, p: Progress, shard: ShardFile, at: tuple[int, int], cell, text, cfg) -> None:
    rg, row = at
    name = member_path(shard.rel, f"{rg}/{row}")
    data = cell.get("bytes") if isinstance(cell, dict) else cell
    if not isinstance(data, bytes):
        what = "null" if data is None else type(data).__name__
        out.problems.append(
            _problem(
                name,
                "parquet",
                f"column {cfg.image_column!r} holds {what}, not image bytes: store the encoded image "
                f"(bytes, or a {{bytes, path}} struct as `datasets` writes it)",
            )
        )
        return
    out.members.append(probe_bytes(data, name).as_json() | {"row_group": rg, "row": row, "column": cfg.image_column})
    if isinstance(text, str):
        p.texts[name] = [text, "metadata"]
