"""The folders a dataset is made of, as every stage sees them: `dataset.path` alone, or `dataset.sources`, plus
`train.eval.path` as a held-out source. Records name their folder by index (ImageRecord.source)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    index: int | None  # None: a plain dataset.path and no eval folder (records then carry no source)
    root: Path
    role: str  # train | regularization | eval
    caption_extension: str
    field: str  # the config field that names the folder, for messages
    repeats: int = 1
    loss_weight: float = 1.0


def dataset_sources(cfg) -> list[Source]:
    d, ev = cfg.dataset, cfg.train.eval
    eval_path = ev.path if ev is not None else None
    if d.sources is None and eval_path is None:
        return [Source(None, cfg.resolve(d.path), "train", d.caption_extension, "dataset.path")]
    if d.sources is None:
        out = [Source(0, cfg.resolve(d.path), "train", d.caption_extension, "dataset.path")]
    else:
        out = [
            Source(
                i,
                cfg.resolve(s.path),
                s.role,
                s.caption_extension or d.caption_extension,
                f"dataset.sources[{i}].path",
                s.repeats,
                s.loss_weight,
            )
            for i, s in enumerate(d.sources)
        ]
    if eval_path is not None:
        out.append(Source(len(out), cfg.resolve(eval_path), "eval", d.caption_extension, "train.eval.path"))
    return out


def training_settings(cfg) -> list[dict]:
    """Per source, what training does with it (train's key; the scan records only say which folder)."""
    return [{"role": s.role, "repeats": s.repeats, "loss_weight": s.loss_weight} for s in dataset_sources(cfg)]
