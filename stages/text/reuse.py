"""Incremental builds: strings the previous published text version already encoded are copied, not re-encoded.

A row depends only on its string and the encoding setup: code version, encoder identity, library versions,
max_length, padding, model and stored dtypes. The caption list (the scan) and the variant settings only decide
which strings are needed, so a new scan or new tag-dropout settings reuse every string they share with the last
version. Only the latest published version is consulted, after the artifact store has verified its files.
"""

from __future__ import annotations

from pathlib import Path

import torch
import zarr

from tuneline.schemas.text import TextManifest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import reusable_previous
from tuneline.stages.text.store import STORE, STRINGS, take_rows

# Settings that pick the strings rather than shape each row's tensors.
STRING_CHOICE = ("caption_variants", "augment")


def encoding_setup(parts: dict) -> dict:
    """From a text key's parts (or a manifest's fields): what every row's tensors depend on."""
    text = {k: v for k, v in parts["config"]["text"].items() if k not in STRING_CHOICE}
    return {
        "code_version": parts["code_version"],
        "text": text,
        "model": parts["config"]["model"],
        "inputs": parts["inputs"],
    }


class PreviousStrings:
    """Rows of one published text version by their exact string."""

    def __init__(self, path: Path, manifest: TextManifest):
        self.path = path
        self.row = {r["text"]: r["row"] for r in read_jsonl(path / STRINGS)}
        group = zarr.open_group(str(path / STORE), mode="r")
        self.arrays = {name: group[name] for name in manifest.fields}

    @classmethod
    def latest(cls, ctx, parts: dict) -> PreviousStrings | None:
        found = reusable_previous(ctx, "text", TextManifest)
        if found is None:
            return None
        path, m = found
        mine = encoding_setup(parts)
        theirs = encoding_setup({"code_version": m.code_version, "config": m.config, "inputs": m.inputs})
        if not m.enabled or theirs != mine:
            return None
        return cls(path, m)

    def __contains__(self, text: str) -> bool:
        return text in self.row

    def take(self, strings: list[str]) -> dict[str, torch.Tensor]:
        rows = [self.row[s] for s in strings]
        return {name: take_rows(a, rows) for name, a in self.arrays.items()}
