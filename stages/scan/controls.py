"""Paired (editing) datasets (dataset.control): each image's control image, matched by path without extension.

`cat.png` pairs with `<control>/cat.<any image extension>`; an image in a subfolder with the same subfolder of the
control folder. A family that takes several reference images (FLUX.2) may instead have a folder
`<control>/cat/` of them, taken in name order (a single file wins over a folder of the same stem). With
dataset.sources, a source's own `control` folder replaces dataset.control for that source.

The control's content hash and size go into the record (each reference's, for several), so an edited control is
new scan content and the latents re-cache it. An image without its control is rejected; controls no image pairs
with are listed in the manifest. The pair is bucketed by the image: the latents stage resizes the control to the
image's size first, as FLUX.1 Kontext training resizes its input to the target's.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.scan import (
    CLIP_FIELDS,
    IMAGE_EXTENSIONS,
    MEMBER_FIELDS,
    MEMBERS,
    PART_FIELDS,
    ControlFile,
    ImageRecord,
    Rejected,
)
from tuneline.schemas.sources import dataset_sources
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.stage import StageFailed
from tuneline.stages.scan import samples
from tuneline.stages.scan.images import probe_file
from tuneline.stages.scan.listing import Listing, walk

FIELDS = ("control_path", "control_sha256", "control_size_bytes", "control_width", "control_height")


def control_root(cfg: PipelineConfig) -> Path | None:
    """dataset.control's folder; None without one (null, or `members`: stages/scan/samples.py)."""
    c = cfg.dataset.control
    return None if c in (None, MEMBERS) else cfg.resolve(c)


def source_roots(cfg: PipelineConfig) -> dict[int | None, tuple[Path | None, str]]:
    """Per record source index: (its control folder or None, the config field naming it)."""
    out: dict[int | None, tuple[Path | None, str]] = {}
    for src in dataset_sources(cfg):
        value, field = samples.control_setting(cfg, src.index)
        out[src.index] = (None if value in (None, MEMBERS) else cfg.resolve(value), field)
    return out


def by_members(cfg: PipelineConfig) -> set[int | None]:
    """The record source indexes whose controls are their samples' own members (stages/scan/samples.py)."""
    return {s.index for s in dataset_sources(cfg) if samples.control_setting(cfg, s.index)[0] == MEMBERS}


def paired(cfg: PipelineConfig) -> bool:
    """Whether a control folder pairs any source (members pair inside their shards: samples.py)."""
    return any(root is not None for root, _ in source_roots(cfg).values())


@dataclass
class Folder:
    """A control folder as the scan walked it (stages/scan/listing.py: symlinks followed only inside it)."""

    root: Path
    listing: Listing
    files: dict[str, list[Path]] = field(default_factory=dict)  # by path without extension ('/' separated)
    refs: dict[str, list[Path]] = field(default_factory=dict)  # a folder's images in name order, by folder path
    bad: dict[str, Rejected] = field(default_factory=dict)  # entries refused while walking, by path

    def problem(self, stem: str) -> Rejected | None:
        """Why the control of the image `stem` cannot be used (a symlink out of the folder, a loop), if so."""
        for rel, bad in self.bad.items():
            if posixpath.splitext(rel)[0] == stem or rel == stem or rel.startswith(stem + "/"):
                return bad
        return None


def folder(cfg: PipelineConfig, root: Path, field: str) -> Folder:
    """Walk a control folder: its images by stem, reference folders, and entries refused."""
    if not root.is_dir():
        raise StageFailed(
            f"{field} {root} is not a folder: point it at your control (input) images, one per "
            f"image with the same name (relative paths resolve against the workdir), or set it to null"
        )
    inside = [s.root for s in dataset_sources(cfg) if root.resolve().is_relative_to(s.root.resolve())]
    if inside:
        raise StageFailed(
            f"{field} {root} is inside the dataset folder {inside[0]}: its images would be trained as "
            f"targets; move the control images to a folder beside it"
        )
    walk_cfg = cfg.dataset.model_copy(update={"extensions": list(IMAGE_EXTENSIONS), "recursive": True})
    out = Folder(root, walk(root, walk_cfg, field))
    for e in out.listing.images:
        out.files.setdefault(posixpath.splitext(e.rel)[0], []).append(Path(e.path))
        if "/" in e.rel:
            out.refs.setdefault(posixpath.dirname(e.rel), []).append(Path(e.path))
    out.bad = {r.path: r for r in out.listing.problems if r.kind != "unsupported"}
    return out


def folders(cfg: PipelineConfig, walked: dict[str, Folder] | None = None) -> dict[str, Folder]:
    """Every control folder of the config by path (`walked`: those already walked in this process)."""
    walked = walked or {}
    roots = sorted({str(r): f for r, f in source_roots(cfg).values() if r is not None}.items())
    return {key: walked.get(key) or folder(cfg, Path(key), f) for key, f in roots}


def fingerprint(found: dict[str, Folder]) -> str | None:
    """The control folders' listings (name, size, mtime; entries refused): an edited control makes the scan
    stale."""
    prints = [f.listing.fingerprint() for f in found.values()]
    if not prints:
        return None
    return digest(prints[0] if len(prints) == 1 else prints)


def consumed(r: ImageRecord, dumped: dict | None = None) -> dict:
    """A record as later stages consume it: without control fields when it has no control, so a dataset without
    pairs keeps the scan version it had before paired datasets existed (and control_references when null, so one
    control per image keeps its version too). `dumped`: the record's JSON dump where the caller has made it."""
    d = r.model_dump(mode="json") if dumped is None else dumped
    skip = {"mtime_ns"} | (set(FIELDS) if r.control_path is None else set())
    skip |= {"control_references"} if r.control_references is None else set()
    if r.shard is None:  # a folder's records keep their version
        skip |= set(MEMBER_FIELDS + PART_FIELDS)
    else:  # and a shard's without mask or control members
        skip |= {f for f in MEMBER_FIELDS + PART_FIELDS if d[f] is None}
    skip |= set(CLIP_FIELDS) if r.frames is None else set()  # an image family's records keep their version
    return {k: v for k, v in d.items() if k not in skip}


def _probe(path: Path, root: Path) -> ControlFile | str:
    """The file's facts, or why it cannot be used."""
    st = path.stat()
    probe = probe_file(path, path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns)
    if probe.error:
        return f"control image {path}: {probe.error}"
    return ControlFile(
        path=probe.path, sha256=probe.sha256, size_bytes=probe.size_bytes, width=probe.width, height=probe.height
    )


def _references(files: list[Path], folder: Path, root: Path) -> dict | str:
    """The control fields of a folder of several references (name order), or why it cannot be used."""
    if not files:
        return f"control folder {folder} holds no image: add the references, or remove the folder"
    refs = [_probe(p, root) for p in files]
    if bad := [r for r in refs if isinstance(r, str)]:
        return bad[0]
    if len(refs) == 1:  # one reference in a folder is one control
        return _fields(refs[0])
    return {
        "control_path": folder.relative_to(root).as_posix(),
        "control_sha256": digest([r.sha256 for r in refs], length=64),
        "control_size_bytes": sum(r.size_bytes for r in refs),
        "control_width": None,
        "control_height": None,
        "control_references": refs,
    }


def _fields(f: ControlFile) -> dict:
    return {
        "control_path": f.path,
        "control_sha256": f.sha256,
        "control_size_bytes": f.size_bytes,
        "control_width": f.width,
        "control_height": f.height,
    }


def _pair(r: ImageRecord, ctl: Folder) -> dict | Rejected:
    def reject(reason: str, kind: str = "control") -> Rejected:
        return Rejected(path=r.ref, kind=kind, reason=reason)

    root, stem = ctl.root, Path(r.path).with_suffix("").as_posix()
    if (bad := ctl.problem(stem)) is not None:  # nothing outside the control folder is read
        return reject(f"its control {root / bad.path}: {bad.reason}", bad.kind)
    found = ctl.files.get(stem)
    if not found:
        if stem in ctl.refs or (root / stem).is_dir():
            got = _references(ctl.refs.get(stem, []), root / stem, root)
            return reject(got) if isinstance(got, str) else got
        return reject(
            f"no control image {root / stem}.* (nor a folder {root / stem}/ of references) for this image "
            f"(the control folder pairs every image with the control of the same name): add it, or remove the image"
        )
    if len(found) > 1:
        return reject(f"several control images match it ({', '.join(p.name for p in found)}): keep one")
    got = _probe(found[0], root)
    return reject(got) if isinstance(got, str) else _fields(got)


def _check_references(kept: list[ImageRecord], cfg: PipelineConfig) -> None:
    """Several references need a family that takes several, and the same number for every image (a training
    batch stacks them)."""
    counts = {r.ref: len(r.control_references or [None]) for r in kept}
    several = [ref for ref, n in counts.items() if n > 1]
    if not several:
        return
    from tuneline.stages.families.registry import family_names, get_family

    def takes_several(name: str) -> bool:
        return get_family(name).multiple_references

    if not takes_several(cfg.model.family):
        raise StageFailed(
            f"{several[0]} has {counts[several[0]]} reference images in a control folder, but family "
            f"{cfg.model.family!r} takes one control image per image: keep one (as <control>/<stem>.png), or "
            f"use a family that takes several ({', '.join(n for n in family_names() if takes_several(n))})"
        )
    a, na = next(iter(counts.items()))
    if other := next(((ref, n) for ref, n in counts.items() if n != na), None):
        b, nb = other
        raise StageFailed(
            f"images take different numbers of reference images ({a}: {na}, {b}: {nb}): give every image the "
            f"same number (a training batch stacks them)"
        )


def attach(
    records: list[ImageRecord], cfg: PipelineConfig, walked: dict[str, Folder] | None = None
) -> tuple[list[ImageRecord], list[Rejected], list[str]]:
    """(records with their control, images rejected for want of one, controls no image pairs with); `walked`: the
    control folders the scan's inputs were fingerprinted from, so the scan pairs what it fingerprinted."""
    if not paired(cfg):
        return records, [], []
    roots, members = source_roots(cfg), by_members(cfg)
    found = folders(cfg, walked)
    kept, rejected, probed, used, named = [], [], {}, {}, set()
    for r in records:
        root, _ = roots[r.source]
        stem = Path(r.path).with_suffix("").as_posix()
        if root is None and r.source in members:  # paired with its sample's member by the scan of its shard
            kept.append(r)
            continue
        if root is None:  # other folders of the dataset are paired, this one not
            got = Rejected(
                path=r.ref,
                kind="control",
                reason=f"its folder has no control images: set dataset.sources[{r.source}].control (or "
                f"dataset.control), or remove the folder from dataset.sources",
            )
        else:
            ctl = found[str(root)]
            files = ctl.files.get(stem) or ctl.refs.get(stem, [])
            used.setdefault(str(root), set()).update(p.relative_to(root).as_posix() for p in files)
            if (str(root), stem) not in probed:  # one probe per control, not per resolution
                probed[str(root), stem] = _pair(r, ctl)
            got = probed[str(root), stem]
        if isinstance(got, Rejected):
            if r.ref not in named:  # once, not once per resolution
                named.add(r.ref)
                rejected.append(got.model_copy(update={"path": r.ref}))
            continue
        kept.append(r.model_copy(update=got))
    _check_references(kept, cfg)
    return kept, rejected, _unmatched(found, used)


def _unmatched(found: dict[str, Folder], used: dict[str, set[str]]) -> list[str]:
    """Control files no image pairs with, relative to their folder."""
    out = set()
    for key, ctl in found.items():
        out.update(e.rel for e in ctl.listing.images if e.rel not in used.get(key, ()))
    return sorted(out)
