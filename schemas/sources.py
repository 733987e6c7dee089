"""The folders a dataset is made of, as every stage sees them: `dataset.path` alone, or `dataset.sources`, plus
`train.eval.path` as a held-out source. Records name their folder by index (ImageRecord.source)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneline.schemas.base import is_url


@dataclass(frozen=True)
class Source:
    index: int | None  # None: a plain dataset.path and no eval folder (records then carry no source)
    root: Path
    role: str  # train | regularization | eval
    caption_extension: str
    field: str  # the config field that names the folder, for messages
    repeats: int = 1
    loss_weight: float = 1.0
    # The path as given once resolved: an absolute path, or an fsspec URL (then `root` is only a name for it).
    location: str = ""
    format: str | None = None  # folder | webdataset | parquet; None = detected by the scan
    storage_options: dict[str, Any] = field(default_factory=dict, compare=False)


def _located(cfg, path: str) -> tuple[Path, str]:
    """(root, location) of a configured path: a URL stays as written, a path resolves against the workdir."""
    if is_url(path):
        return Path(path.split("://", 1)[1]), path
    root = cfg.resolve(path)
    return root, str(root)


def dataset_sources(cfg) -> list[Source]:
    d, ev = cfg.dataset, cfg.train.eval
    eval_path = ev.path if ev is not None else None
    plain = {"format": d.format, "storage_options": d.storage_options}
    if d.sources is None and eval_path is None:
        return [_source(cfg, None, d.path, "train", d.caption_extension, "dataset.path", **plain)]
    if d.sources is None:
        out = [_source(cfg, 0, d.path, "train", d.caption_extension, "dataset.path", **plain)]
    else:
        out = [
            _source(
                cfg,
                i,
                s.path,
                s.role,
                s.caption_extension or d.caption_extension,
                f"dataset.sources[{i}].path",
                s.repeats,
                s.loss_weight,
                format=s.format,
                storage_options=s.storage_options or d.storage_options,
            )
            for i, s in enumerate(d.sources)
        ]
    if eval_path is not None:
        out.append(_source(cfg, len(out), eval_path, "eval", d.caption_extension, "train.eval.path"))
    return out


def _source(cfg, index, path: str, *args, format=None, storage_options=None) -> Source:  # noqa: A002
    root, location = _located(cfg, path)
    return Source(index, root, *args, location=location, format=format, storage_options=dict(storage_options or {}))


def training_settings(cfg) -> list[dict]:
    """Per source, what training does with it (train's key; the scan records only say which folder)."""
    return [{"role": s.role, "repeats": s.repeats, "loss_weight": s.loss_weight} for s in dataset_sources(cfg)]
