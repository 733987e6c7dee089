"""Text rows per (instruction, control image), for a family whose text encoder sees the control image
(Qwen-Image-Edit's vision-language encoder: `text_sees_control`) trained on a paired dataset.

Each row's key is `<control sha256>\\x1f<string>`: the string (each caption variant, and "" for caption dropout) with
the content hash of the control image it was encoded with. The keys are the cache's strings (strings.jsonl), so an
incremental build reuses a row exactly when both the string and the control image's content are unchanged: an
edited control re-encodes its own rows and nothing else. Row 0 stays the plain empty string (text only), which every
text cache holds. controls.jsonl in the artifact lists the control images (sha256, file) the rows were encoded from;
its presence tells readers (TextCache.paired) to look rows up by pair_key. A record without a control (a source
without one) keys its rows by the plain string, encoded text only.

Other families, and this one without pairs (dataset.control null), build the plain string cache.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from tuneline.schemas.scan import IMAGE_EXTENSIONS, ScanManifest
from tuneline.stages.caption import upstream_captions
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.families import resolve as models
from tuneline.stages.scan.images import load_rgb
from tuneline.stages.scan.members import ControlMember, control_file
from tuneline.stages.text.store import CONTROLS, SEP, pair_key
from tuneline.stages.text.variants import TagAugment

__all__ = ["CONTROLS", "encode_keys", "index_pairs", "pair_key", "paired_captions", "split_key"]


def split_key(key: str) -> tuple[str | None, str]:
    """(control sha256 or None for a text-only row, the string)."""
    sha, sep, text = key.partition(SEP)
    return (sha, text) if sep else (None, key)


def sees_control(fam) -> bool:
    return fam.text_sees_control


def paired_captions(ctx, scan: ScanManifest, upstream: dict) -> tuple[list[tuple[str, str]], dict[str, Path]] | None:
    """((caption, control sha256) of each distinct pair in record order, sha256 -> control file), or None when the
    family's text encoder does not see controls or the scan holds no pairs. A record without a control (a source
    without one) gives (caption, None): a text-only row."""
    if not sees_control(models.family(ctx.cfg)):
        return None
    scan_dir = models.artifact_dir(ctx, scan)
    roots = scan.control_sources()  # record.source -> its control folder, or its source (a sample's control member)
    captions = upstream_captions(ctx, upstream) or {}
    pairs: dict[tuple[str, str], None] = {}
    files: dict[str, Path] = {}
    for r in read_jsonl(scan_dir / "images.jsonl"):
        ref = r["path"] if r.get("source") is None else f"{r['source']}//{r['path']}"
        sha = r.get("control_sha256")
        pairs.setdefault((captions.get(ref, r["caption"]), sha), None)
        if sha:
            files.setdefault(sha, control_file(roots, r))
    return (list(pairs), files) if files else None


def index_pairs(pairs: list[tuple[str, str | None]], augment: TagAugment) -> tuple[list[str], dict[str, list[int]]]:
    """(distinct keys to encode, pair key -> the row of each variant), as variants.index_strings for strings:
    row 0 is the plain "", then each control's empty instruction (caption dropout), then the pairs' variants."""
    rows_of: dict[str, int] = {"": 0}
    index: dict[str, list[int]] = {"": [0] * augment.variants}
    shas = list(dict.fromkeys(sha for _, sha in pairs if sha))
    for caption, sha in [("", s) for s in shas] + pairs:
        key = pair_key(caption, sha)
        if key not in index:
            index[key] = [rows_of.setdefault(pair_key(s, sha), len(rows_of)) for s in augment.all(caption)]
    return list(rows_of), index


def load_control(path: Path | ControlMember, sha256: str):
    """The control image (RGB, upright), or a folder's reference images in name order (the scan's control_sha256
    is then the digest of theirs); refused when the content is no longer what the scan hashed."""
    if isinstance(path, ControlMember):  # a sample's control member, read by its byte range (hash checked)
        return load_rgb(io.BytesIO(path.read_bytes()))
    path = Path(path)
    if path.is_dir():
        # The scan's references: image files in name order, hidden files left out (stages/scan/controls.py).
        files = [p for p in sorted(path.iterdir(), key=lambda p: p.name) if p.suffix.lower() in IMAGE_EXTENSIONS]
        files = [p for p in files if p.is_file() and not p.name.startswith(".")]
        if digest([hashlib.sha256(p.read_bytes()).hexdigest() for p in files], length=64) != sha256:
            raise ValueError(
                f"control folder {path} changed since the scan (its references' sha256 differ from the scan's "
                f"record): run `tuneline run --until text` (it rescans, then encodes the new pairs)"
            )
        return [load_rgb(p) for p in files]
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(
            f"control image {path} changed since the scan (its sha256 differs from the scan's record): run "
            f"`tuneline run --until text` (it rescans, then encodes the new pairs)"
        )
    return load_rgb(Path(path))


def encode_keys(fam, enc, keys: list[str], files: dict[str, Path], batch_size: int) -> dict:
    """Every tensor the family returns for `keys`, in order: text-only rows through encode_text(enc, strings),
    paired rows through encode_text(enc, strings, control images)."""
    import torch

    from tuneline.stages.families.encode import encode_strings

    plain = [i for i, k in enumerate(keys) if split_key(k)[0] is None]
    paired = [i for i, k in enumerate(keys) if split_key(k)[0] is not None]
    parts: list[tuple[list[int], dict]] = []
    if plain:
        parts.append((plain, encode_strings(fam, enc, [keys[i] for i in plain], batch_size)))
    for start in range(0, len(paired), batch_size):
        idx = paired[start : start + batch_size]
        split = [split_key(keys[i]) for i in idx]
        images = [load_control(files[sha], sha) for sha, _ in split]
        with torch.no_grad():
            out = fam.encode_text(enc, [text for _, text in split], images)
        parts.append((idx, {k: v.detach() for k, v in out.items()}))
    order = torch.tensor([i for idx, _ in parts for i in idx]).argsort()
    return {k: torch.cat([p[k] for _, p in parts])[order] for k in parts[0][1]}
