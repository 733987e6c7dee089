"""Loss masks (dataset.masks): which mask each accepted image has, checked against its image's size.

`alpha` takes the image's own alpha channel (images without one weigh fully); a folder is matched by file stem;
`members` are a webdataset sample's own `key.mask.<ext>` members (stages/scan/samples.py).
The mask file's hash goes into the record, so a changed mask is new scan content and the latents re-cache it.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.scan import IMAGE_EXTENSIONS, MEMBERS, ImageRecord, Rejected
from tuneline.stages.common.hashing import digest, file_sha256
from tuneline.stages.common.stage import StageFailed

ALPHA = "alpha"


def mask_root(cfg: PipelineConfig) -> Path | None:
    """The mask folder, or None for alpha / members / no masks."""
    m = cfg.dataset.masks
    return None if m in (None, ALPHA, MEMBERS) else cfg.resolve(m)


def _index(root: Path) -> dict[str, Path]:
    if not root.is_dir():
        raise StageFailed(
            f"dataset.masks {root} is not a folder: point it at your mask images "
            f"(relative paths resolve against the workdir), use alpha, or set it to null"
        )
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    return {p.stem: p for p in files}


def fingerprint(cfg: PipelineConfig) -> str | None:
    """The mask folder's listing (name, size, mtime): a changed mask makes the scan stale."""
    root = mask_root(cfg)
    if root is None or not root.is_dir():
        return None
    return digest([(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in _index(root).values()])


def attach(records: list[ImageRecord], cfg: PipelineConfig) -> tuple[list[ImageRecord], list[Rejected]]:
    """Records with their mask fields set; images whose mask does not fit them are rejected naming both."""
    if cfg.dataset.masks in (None, MEMBERS):  # members: attached with the shard's records (samples.py)
        return records, []
    if cfg.dataset.masks == ALPHA:
        return [r.model_copy(update={"mask_kind": ALPHA}) if r.background is not None else r for r in records], []
    root = mask_root(cfg)
    index = _index(root)
    kept, rejected = [], []
    for r in records:
        mask = index.get(Path(r.path).stem)
        if mask is None:
            kept.append(r)
            continue
        with Image.open(mask) as im:
            size = im.size
        if size != (r.width, r.height):
            rejected.append(
                Rejected(
                    path=r.ref,
                    kind="mask",
                    reason=(
                        f"mask {mask} is {size[0]}x{size[1]} but image {r.path} is {r.width}x{r.height}: resize the mask "
                        f"to its image or remove it"
                    ),
                )
            )
            continue
        kept.append(
            r.model_copy(
                update={
                    "mask_kind": "file",
                    "mask_path": mask.relative_to(root).as_posix(),
                    "mask_sha256": file_sha256(mask),
                }
            )
        )
    return kept, rejected
