"""Validation prompts and negative prompts, encoded once each and optionally kept in a small file.

Separate from the text stage on purpose: prompts are the validate stage's config, and putting them into the text
artifact would make a prompt edit re-run text, training and everything after it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tuneline.stages.families.base import Family, TextEncoders
from tuneline.stages.families.encode import encode_strings

Encoded = dict[str, dict[str, torch.Tensor]]
log = logging.getLogger("tuneline")


def encode_prompts(
    fam: Family,
    enc: TextEncoders | Callable[[], TextEncoders],
    prompts: list[str],
    *,
    cache: Path | None = None,
    key: str = "",
) -> Encoded:
    """prompt -> every tensor the family returns for it (batch 1), each distinct prompt encoded once; pass
    negative prompts in the same list (they share rows when equal, e.g. ""). Feed pairs to fam.prompt_kwargs.

    `enc` may be a zero-argument loader: it is called only when some prompt is not in `cache`. `cache` is a
    .safetensors file of earlier encodings; entries count only under the same `key` (say the encoder identity,
    max length and dtype), new prompts are added and the file is replaced atomically. Tensors come back on the
    encoders' device, or on the CPU when read from the file: `batch_of` puts them on one device."""
    wanted = list(dict.fromkeys(prompts))
    have = load_prompts(cache, key) if cache is not None else {}
    todo = [p for p in wanted if p not in have]
    if todo:
        encoders = enc() if callable(enc) else enc
        out = encode_strings(fam, encoders, todo)
        have.update({p: {k: v[i : i + 1] for k, v in out.items()} for i, p in enumerate(todo)})
        if cache is not None:
            save_prompts(cache, key, have)
    return {p: have[p] for p in wanted}


def batch_of(encoded: Encoded, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of `prompts`, in order, as one batch on `device` (one pipeline call's prompts or negatives)."""
    return {k: torch.cat([encoded[p][k].to(device) for p in prompts]) for k in encoded[prompts[0]]}


def save_prompts(path: Path, key: str, encoded: Encoded) -> None:
    path = Path(path)
    order = list(encoded)
    tensors = {f"{i}/{k}": v.detach().cpu().contiguous() for i, p in enumerate(order) for k, v in encoded[p].items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp), metadata={"key": key, "prompts": json.dumps(order), "sha256": checksum(tensors)})
    os.replace(tmp, path)


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_prompts(path: Path, key: str) -> Encoded:
    """What `path` holds for `key`; empty when the file is missing, unreadable, made under another key, or its
    tensors fail the checksum it carries or hold NaN/Inf (it is then rebuilt, never trusted)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return {}
            order = json.loads(meta["prompts"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError, KeyError, ValueError):
        return {}
    if meta.get("sha256") != checksum(tensors) or not all(torch.isfinite(t).all() for t in tensors.values()):
        log.warning("validation-prompt cache %s fails its checksum (changed since it was written): rebuilding it", path)
        return {}
    out: Encoded = {p: {} for p in order}
    try:
        for name, t in tensors.items():
            i, field = name.split("/", 1)
            out[order[int(i)]][field] = t
    except (IndexError, ValueError):
        return {}
    return out
