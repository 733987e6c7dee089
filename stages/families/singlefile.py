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

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")


def convert_single_file(family: Any, file: Path, cache_dir: Path) -> Path:
    """The cached diffusers folder for `file`, converting it on first use. Keyed by the file's path, size and
    mtime so an edited checkpoint is converted again rather than silently reusing the old conversion."""
    name = family.facts.name
    if file.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        raise ValueError(f"model.path: {file} is neither a diffusers folder nor a single checkpoint file "
                         f"({', '.join(SINGLE_FILE_SUFFIXES)})")
    if not hasattr(family.pipeline_class, "from_single_file"):
        raise ValueError(f"model.path: {file}: diffusers cannot load family {name!r} from a single file; "
                         f"convert it to a diffusers folder and point model.path at that")
    st = file.stat()
    key = hashlib.sha256(f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = Path(cache_dir) / f"{name}-single-{file.stem}-{key}"
    if target.is_dir():
        family.check_folder(target)
        return target
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        _convert(family, file, tmp)
        family.check_folder(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(family: Any, file: Path, out_dir: Path) -> None:
    try:
        pipe = family.pipeline_class.from_single_file(str(file), local_files_only=True,
                                                      **family.pipeline_load_kwargs())
    except Exception as exc:  # diffusers raises many kinds here; the user needs the file name and the fix
        raise ValueError(
            f"model.path: cannot load {file} as a single-file {family.facts.name!r} checkpoint "
            f"({type(exc).__name__}: {exc}). diffusers needs the pipeline's configs, which cannot be downloaded "
            f"here; convert the checkpoint to a diffusers folder where a model hub is reachable and point "
            f"model.path at that folder") from exc
    pipe.save_pretrained(out_dir, safe_serialization=True)
