"""Model folders without loading a model: is a diffusers folder complete for a family, and what is the identity of
each component. Pure file work (no torch, no diffusers), so `tuneline status` and stage planning stay fast."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tuneline.schemas.families import FamilyFacts
from tuneline.stages.common.hashing import HashCache

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")
# Files of a tokenizer folder that change what token ids come out.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "special_tokens_map.json",
)


def user_cache_dir() -> Path:
    """The user's tuneline cache (TUNELINE_CACHE_DIR, else XDG_CACHE_HOME or ~/.cache): kept across workdirs."""
    root = os.environ.get("TUNELINE_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "tuneline"
    )
    return Path(root)


def hash_cache() -> HashCache:
    """One per user: identities survive across workdirs."""
    return HashCache(user_cache_dir() / "file-hashes.json")


def required_components(facts: FamilyFacts) -> tuple[str, ...]:
    return ("vae", "scheduler", facts.denoiser, *facts.text_encoders, *facts.tokenizers)


def pipeline_class_names(facts: FamilyFacts) -> tuple[str, ...]:
    """model_index.json `_class_name`s a family accepts: its pipeline and the img2img/inpaint variants that share
    the same components."""
    base = facts.pipeline.removesuffix("Pipeline")
    return tuple(f"{base}{v}Pipeline" for v in ("", "Img2Img", "Inpaint"))


def tiny_dir(facts: FamilyFacts, cache_dir: Path) -> Path:
    """Where the family's tiny flavor is built (a new revision gets a new folder)."""
    return Path(cache_dir) / f"{facts.name}-tiny-r{facts.tiny_revision}"


def check_folder(facts: FamilyFacts, folder: Path) -> None:
    """A folder is usable when model_index.json lists every component the family needs and each exists."""
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise ValueError(f"model.path: {folder} is not a diffusers pipeline folder (no model_index.json)")
    index = json.loads(index_file.read_text())
    cls, accepted = index.get("_class_name", ""), pipeline_class_names(facts)
    if cls not in accepted:
        raise ValueError(
            f"model.path: {folder} holds a {cls or 'unknown'} pipeline, not family {facts.name!r} "
            f"({' / '.join(accepted)}); fix model.family or model.path"
        )
    needed = required_components(facts)
    missing = [c for c in needed if not index.get(c) or index[c] == [None, None] or not (folder / c).is_dir()]
    if missing:
        raise ValueError(
            f"model.path: {folder} lacks component {', '.join(map(repr, missing))} needed by "
            f"family {facts.name!r} (not in model_index.json or no such subfolder)"
        )
    for comp in needed:
        problem = _component_problem(facts, folder / comp, comp)
        if problem:
            raise ValueError(f"model.path: {folder}: component {comp!r} {problem}")


def _component_problem(facts: FamilyFacts, sub: Path, comp: str) -> str | None:
    if comp in facts.tokenizers:
        return None if any((sub / f).is_file() for f in TOKENIZER_FILES) else "has no tokenizer files"
    config = "scheduler_config.json" if comp == "scheduler" else "config.json"
    if not (sub / config).is_file():
        return f"has no {config}"
    if comp != "scheduler" and not weight_files(sub):
        return "has no weight files (.safetensors/.bin)"
    return None


def identity(facts: FamilyFacts, model_dir: Path, component: str) -> str:
    """Stable hash of a component's configs and weights by content (names inside the folder and bytes), so the
    same weights in another folder have the same identity. File hashes come from the on-disk HashCache."""
    # 'text' covers tokenizers too: a different vocabulary changes the embeddings as much as new weights; the
    # denoiser's covers the noise scheduler, whose config (prediction type, schedule) sets the training target.
    named = {
        "vae": ("vae",),
        "denoiser": (facts.denoiser, "scheduler"),
        "text": (*facts.text_encoders, *facts.tokenizers),
    }
    files = sorted(f for c in named.get(component, (component,)) for f in _identity_files(Path(model_dir) / c))
    if not files:
        raise ValueError(f"{model_dir}: nothing to identify for component {component!r}")
    cache = hash_cache()
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.parent.name}/{f.name}\0{cache.sha256(f)}\0".encode())
    cache.save()
    return h.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    return [f for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)]


def _identity_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    named = [folder / n for n in ("config.json", "scheduler_config.json", *TOKENIZER_FILES)]
    return [f for f in named if f.is_file()] + weight_files(folder)
