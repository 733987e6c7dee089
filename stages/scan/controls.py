"""Paired (editing) datasets (dataset.control): each image's control image, matched by path without extension.

`cat.png` pairs with `<control>/cat.<any image extension>`; an image in a subfolder with the same subfolder of the
control folder. The control's content hash and size go into the record, so an edited control is new scan content
and the latents re-cache it. An image without its control is rejected; controls no image pairs with are listed in
the manifest. The pair is bucketed by the image: the latents stage resizes the control to the image's size first,
as FLUX.1 Kontext training resizes its input to the target's.
"""

from __future__ import annotations

from pathlib import Path

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.scan import IMAGE_EXTENSIONS, ImageRecord, Rejected
from tuneline.schemas.sources import dataset_sources
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.stage import StageFailed
from tuneline.stages.scan.images import probe_file

FIELDS = ("control_path", "control_sha256", "control_size_bytes", "control_width", "control_height")


def control_root(cfg: PipelineConfig) -> Path | None:
    c = cfg.dataset.control
    return None if c is None else cfg.resolve(c)


def _index(cfg: PipelineConfig) -> dict[str, list[Path]]:
    """Control files by path without extension, relative to the control folder ('/' separated)."""
    root = control_root(cfg)
    if not root.is_dir():
        raise StageFailed(
            f"dataset.control {root} is not a folder: point it at your control (input) images, one per "
            f"image with the same name (relative paths resolve against the workdir), or set it to null"
        )
    inside = [s.root for s in dataset_sources(cfg) if root.resolve().is_relative_to(s.root.resolve())]
    if inside:
        raise StageFailed(
            f"dataset.control {root} is inside the dataset folder {inside[0]}: its images would be trained as "
            f"targets; move the control images to a folder beside it"
        )
    out: dict[str, list[Path]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith("."):
            out.setdefault(p.relative_to(root).with_suffix("").as_posix(), []).append(p)
    return out


def fingerprint(cfg: PipelineConfig) -> str | None:
    """The control folder's listing (name, size, mtime): an edited control makes the scan stale."""
    root = control_root(cfg)
    if root is None or not root.is_dir():
        return None
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return digest([(p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files])


def consumed(r: ImageRecord) -> dict:
    """A record as later stages consume it: without control fields when it has no control, so a dataset without
    pairs keeps the scan version it had before paired datasets existed."""
    skip = {"mtime_ns"} | (set(FIELDS) if r.control_path is None else set())
    return r.model_dump(mode="json", exclude=skip)


def _pair(r: ImageRecord, found: list[Path] | None, root: Path) -> ImageRecord | Rejected:
    def reject(reason: str) -> Rejected:
        return Rejected(path=r.ref, kind="control", reason=reason)

    stem = Path(r.path).with_suffix("").as_posix()
    if not found:
        return reject(
            f"no control image {root / stem}.* for this image (dataset.control pairs every image with the "
            f"control of the same name): add it, or remove the image"
        )
    if len(found) > 1:
        return reject(f"several control images match it ({', '.join(p.name for p in found)}): keep one")
    path = found[0]
    st = path.stat()
    probe = probe_file(path, path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns)
    if probe.error:
        return reject(f"control image {path}: {probe.error}")
    return r.model_copy(
        update={
            "control_path": probe.path,
            "control_sha256": probe.sha256,
            "control_size_bytes": probe.size_bytes,
            "control_width": probe.width,
            "control_height": probe.height,
        }
    )


def attach(records: list[ImageRecord], cfg: PipelineConfig) -> tuple[list[ImageRecord], list[Rejected], list[str]]:
    """(records with their control, images rejected for want of one, controls no image pairs with)."""
    if cfg.dataset.control is None:
        return records, [], []
    root, index = control_root(cfg), _index(cfg)
    kept, rejected, probed, used, named = [], [], {}, set(), set()
    for r in records:
        stem = Path(r.path).with_suffix("").as_posix()
        used.add(stem)
        if stem not in probed:  # one probe per control, not per resolution
            probed[stem] = _pair(r, index.get(stem), root)
        got = probed[stem]
        if isinstance(got, Rejected):
            if r.ref not in named:  # once, not once per resolution
                named.add(r.ref)
                rejected.append(got.model_copy(update={"path": r.ref}))
            continue
        kept.append(r.model_copy(update={k: getattr(got, k) for k in FIELDS}))
    unmatched = sorted(p.relative_to(root).as_posix() for s, ps in index.items() if s not in used for p in ps)
    return kept, rejected, unmatched
