"""Masks and controls kept in a WebDataset sample as members of their own (dataset.masks / dataset.control
`members`): `key.mask.png` is the loss mask of `key.jpg` and `key.control.png` its control (input) image, as a mask
folder and a control folder pair files with images by stem.

The scan's one streaming pass over a shard records each such member's byte range, content hash and header beside
its image (shardindex.py); the records carry them (`mask_offset`, `control_offset`, the paths naming the members),
and the latents stage reads the members by those ranges, as it reads images. A changed mask or control changes
its hash, so it is new scan content. Rules as for folders: an image without a mask member weighs fully, a mask
must have its image's size, an image without its control member is rejected.
"""

from __future__ import annotations

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.scan import MEMBERS, ImageRecord, Rejected
from tuneline.schemas.sources import Source
from tuneline.stages.common.stage import StageFailed
from tuneline.stages.scan.images import Probe

ROLES = ("mask", "control")
FACTS = ("path", "sha256", "size_bytes", "width", "height", "error")


def role(ext: str, images: set[str]) -> str | None:
    """'mask' or 'control' for a member's extension `mask.png` / `control.jpg`, else None."""
    name, _, image = ext.partition(".")
    return name if name in ROLES and image in images else None


def facts(probe: Probe, offset: int) -> dict:
    """What a record needs of a mask or control member: its name, where its bytes are, its hash and size."""
    return {k: getattr(probe, k) for k in FACTS} | {"offset": offset}


def control_setting(cfg: PipelineConfig, index: int | None) -> tuple[str | None, str]:
    """(the control setting of the source with this record index, the config field holding it)."""
    own = [s.control for s in cfg.dataset.sources or []]
    mine = own[index] if index is not None and index < len(own) else None
    return (mine, f"dataset.sources[{index}].control") if mine else (cfg.dataset.control, "dataset.control")


def used(cfg: PipelineConfig, src: Source) -> list[str]:
    """The config fields that take this source's mask / control members."""
    control, field = control_setting(cfg, src.index)
    return (["dataset.masks"] if cfg.dataset.masks == MEMBERS else []) + ([field] if control == MEMBERS else [])


def check(cfg: PipelineConfig, src: Source, fmt: str) -> None:
    """Members are a webdataset sample's: refused, naming the fields, for a folder or a parquet table."""
    fields = used(cfg, src)
    if fields and fmt != "webdataset":
        raise StageFailed(
            f"{' and '.join(fields)} is `members` (a webdataset sample's key.mask.<ext> / key.control.<ext> members), "
            f"but {src.field} {src.location} is a {fmt} source: point {' and '.join(fields)} at a folder of mask / "
            f"control images (or alpha for masks), or pack the samples into webdataset shards"
        )


def attach(
    records: list[ImageRecord], parts: dict[str, dict], cfg: PipelineConfig, src: Source
) -> tuple[list[ImageRecord], list[Rejected]]:
    """Records with their mask and control members; images whose member does not fit them are rejected (once,
    not once per resolution)."""
    fields = used(cfg, src)
    if not fields:
        return records, []
    masks, paired = "dataset.masks" in fields, len(fields) > ("dataset.masks" in fields)
    kept, rejected, named = [], [], set()
    for r in records:
        mine = parts.get(r.path, {})
        got = (_mask(r, mine.get("mask")) if masks else {}) or {}
        if paired and not isinstance(got, Rejected):
            control = _control(r, mine.get("control"), fields[-1])
            got = control if isinstance(control, Rejected) else got | control
        if isinstance(got, Rejected):
            if r.ref not in named:
                named.add(r.ref)
                rejected.append(got)
            continue
        kept.append(r.model_copy(update=got))
    return kept, rejected


def _mask(r: ImageRecord, m: dict | None) -> dict | Rejected | None:
    """The record's mask fields (None: no mask member, the image weighs fully), or why its mask is refused."""
    if m is None:
        return None
    if m["error"] or (m["width"], m["height"]) != (r.width, r.height):
        why = m["error"] or (
            f"it is {m['width']}x{m['height']} but its image is {r.width}x{r.height}: resize the mask to its image"
        )
        return Rejected(path=r.ref, kind="mask", reason=f"mask member {m['path']}: {why} (or remove it)")
    return {
        "mask_kind": "member",
        "mask_path": m["path"],
        "mask_sha256": m["sha256"],
        "mask_offset": m["offset"],
        "mask_size_bytes": m["size_bytes"],
    }


def _control(r: ImageRecord, c: dict | None, field: str) -> dict | Rejected:
    """The record's control fields, or why it has none it can use."""
    if c is None:
        key = r.path.rsplit(".", 1)[0]
        return Rejected(
            path=r.ref,
            kind="control",
            reason=f"no control member {key}.control.<ext> for this image ({field} is members: every sample holds "
            f"its control image): add it to the sample, or remove the image",
        )
    if c["error"]:
        return Rejected(path=r.ref, kind="control", reason=f"control member {c['path']}: {c['error']}")
    return {
        "control_path": c["path"],
        "control_sha256": c["sha256"],
        "control_size_bytes": c["size_bytes"],
        "control_width": c["width"],
        "control_height": c["height"],
        "control_offset": c["offset"],
    }
