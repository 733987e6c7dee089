"""Single checkpoint files (.safetensors / .ckpt) converted once into a diffusers folder in the cache.

diffusers' `from_single_file` needs the pipeline's configs; with no model hub here it finds them only in the local
Hugging Face cache (or not at all), so a failure becomes an error naming the file and the way out.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from schemas.model import SHIPPED_CONFIGS
from stages.families.shipped import resolve_config

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")


# The original checkpoints' families by a key prefix only that family's layout has (checked in this order; a
# "model.diffusion_model." prefix, as ComfyUI and A1111 save flux/sd3, is looked through).
LAYOUT_KEYS = (("sdxl", "conditioner.embedders.1."), ("sd15", "cond_stage_model.transformer."),
               ("sd3", "joint_blocks."), ("flux", "double_blocks."))
SAME_LAYOUT = {"tiny": "sd15"}  # the tiny family is SD1.5's architecture


def checkpoint_family(file: Path) -> str | None:
    """The family whose original layout a .safetensors file's tensor names have, or None (unknown, or .ckpt)."""
    if file.suffix.lower() != ".safetensors":
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            keys = [k.removeprefix("model.diffusion_model.") for k in f.keys()]
    except Exception:  # an unreadable file: the conversion below reports it with the way out
        return None
    for name, prefix in LAYOUT_KEYS:
        if any(k.startswith(prefix) for k in keys):
            return name
    return None


def convert_single_file(family: Any, file: Path, cache_dir: Path, config: str | None = None) -> Path:
    """The cached diffusers folder for `file`, converting it on first use. Keyed by the file's path, size and
    mtime (and the config folder) so an edited checkpoint is converted again rather than silently reusing the old
    conversion."""
    name = family.facts.name
    if file.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        raise ValueError(f"model.path: {file} is neither a diffusers folder nor a single checkpoint file "
                         f"({', '.join(SINGLE_FILE_SUFFIXES)})")
    if not hasattr(family.pipeline_class, "from_single_file"):
        raise ValueError(f"model.path: {file}: diffusers cannot load family {name!r} from a single file; "
                         f"convert it to a diffusers folder and point model.path at that")
    found, want = checkpoint_family(file), SAME_LAYOUT.get(name, name)
    if found is not None and found != want:
        raise ValueError(f"model.path: {file} is a {found} checkpoint (its tensor names are {found}'s original "
                         f"layout) but model.family is {name}; set model.family {found}, or point model.path at a "
                         f"{want} checkpoint")
    config, shipped = resolve_config(name, file, config)
    if config is not None and not shipped:  # shipped folders hold no weights; tests check them
        try:
            family.check_folder(Path(config))
        except ValueError as err:  # the folder check names model.path; here the folder is model.config
            raise ValueError(str(err).replace("model.path", "model.config", 1)) from None
    st = file.stat()
    ident = f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}" + (f"\0{Path(config).resolve()}" if config else "")
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    target = Path(cache_dir) / f"{name}-single-{file.stem}-{key}"
    if target.is_dir():
        family.check_folder(target)
        return target
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        _convert(family, file, tmp, config)
        family.check_folder(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(family: Any, file: Path, out_dir: Path, config: str | None) -> None:
    extra = {"config": str(config)} if config is not None else {}
    try:
        pipe = family.pipeline_class.from_single_file(str(file), local_files_only=True, **extra,
                                                      **family.pipeline_load_kwargs())
    except Exception as exc:  # diffusers raises many kinds here; the user needs the file name and the fix
        raise ValueError(
            f"model.path: cannot load {file} as a single-file {family.facts.name!r} checkpoint "
            f"({type(exc).__name__}: {exc}). diffusers needs the pipeline's configs, which cannot be downloaded "
            f"here; set model.config to a shipped config name ({', '.join(SHIPPED_CONFIGS)}) or a local diffusers folder of the same model (its configs and tokenizers "
            f"are read, not its weights), or convert the checkpoint to a diffusers folder where a model hub is "
            f"reachable and point model.path at that folder") from exc
    pipe.save_pretrained(out_dir, safe_serialization=True)
