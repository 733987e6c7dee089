"""Reading a published caption artifact for people: `.txt` sidecars to review and edit, a printed sample, and
the sample rows the Prefect run shows. Nothing here writes into a dataset folder."""

from __future__ import annotations

import posixpath
from pathlib import Path

from tuneline.schemas.scan import ScanManifest
from tuneline.schemas.sources import dataset_sources
from tuneline.stages.caption import CAPTIONS
from tuneline.stages.common.artifacts import ArtifactError, safe_join
from tuneline.stages.common.jsonl import read_jsonl


def rows(caption_dir: Path) -> list[dict]:
    return list(read_jsonl(caption_dir / CAPTIONS))


def editable_text(row: dict, trigger: str) -> str:
    """The caption without the trigger the stage prepends (the trigger is added again on the next run)."""
    text = row["caption"]
    if trigger and text.startswith(trigger):
        text = text[len(trigger) :].removeprefix(",").strip()
    return text


def export(cfg, src: Path, to: Path | None = None) -> tuple[Path, int]:
    """Write one sidecar per image of the caption artifact `src` (its path with the caption extension) under `to`
    (default <workdir>/captions/<version>/); images of dataset.sources go under their source index. Returns
    (folder, count)."""
    out = Path(to).expanduser().resolve() if to is not None else cfg.workdir_path() / "captions" / src.name
    for s in dataset_sources(cfg):
        root = s.root.expanduser().resolve()
        if out == root or out.is_relative_to(root):
            raise ArtifactError(
                f"--to {out} is inside the dataset folder {root}: captions are never written into "
                f"the dataset; export elsewhere and copy back the files you edited"
            )
    ext = {s.index: s.caption_extension or cfg.dataset.caption_extension for s in dataset_sources(cfg)}
    n = 0
    for r in rows(src):
        head, sep, path = r["ref"].partition("//")
        source = int(head) if sep else None
        rel = posixpath.splitext(path if sep else r["ref"])[0] + ext.get(source, cfg.dataset.caption_extension)
        target = safe_join(out / head if sep else out, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(editable_text(r, cfg.caption.trigger) + "\n", encoding="utf-8")
        n += 1
    return out, n


def sample(caption_dir: Path, count: int = 8) -> list[dict]:
    """Up to `count` rows spread over the artifact, model captions first (those are the ones to check)."""
    every = rows(caption_dir)
    ordered = [r for r in every if r["source"] == "model"] + [r for r in every if r["source"] != "model"]
    step = max(1, len(ordered) // count) if len(ordered) > count else 1
    return ordered[::step][:count]


def image_paths(store, caption_manifest, picked: list[dict]) -> list[Path | None]:
    """Each picked row's image file (None when its folder is not known)."""
    scan = store.read(store.version_dir("scan", caption_manifest.upstream["scan"]), ScanManifest)
    roots = scan.roots()
    out = []
    for r in picked:
        head, sep, path = r["ref"].partition("//")
        root = roots.get(int(head) if sep else None)
        out.append(None if root is None else safe_join(root, path if sep else r["ref"]))
    return out


def show_lines(caption_dir: Path, count: int = 8) -> list[str]:
    rs = rows(caption_dir)
    head = (
        f"{len(rs)} images: {sum(r['source'] == 'model' for r in rs)} model captions, "
        f"{sum(r['source'] == 'user' for r in rs)} user captions ({caption_dir})"
    )
    return [head, *(f"[{r['source']}] {r['ref']}: {r['caption']}" for r in sample(caption_dir, count))]
