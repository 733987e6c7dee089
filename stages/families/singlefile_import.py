"""Single checkpoint files (.safetensors / .ckpt) converted once into a diffusers folder in the cache.

diffusers' `from_single_file` needs the pipeline's configs; with no model hub here they come from model.config (a
shipped weightless folder, stages/families/shipped.py, or a local diffusers folder), and a failure becomes an error
naming the file and the way out. Components the file has no tensors for (SD3/Flux files often hold only the
transformer) are loaded from model.config's weights; a family may read its denoiser itself (single_file_denoiser).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tuneline.schemas.families import facts
from tuneline.schemas.model import SHIPPED_CONFIGS
from tuneline.stages.families.shipped import resolve_config
from tuneline.stages.families.split_files import build_once, check_fits, checkpoint_family as marked_family

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")


# The original checkpoints' families by a key prefix only that family's layout has (its schemas/families.py row:
# checkpoint_marker; a "model.diffusion_model." prefix, as ComfyUI and A1111 save DiT files, is looked through).
# Where each weighted component other than the denoiser lives is in the row too (checkpoint_components): many
# transformer files hold the denoiser alone (BFL's flux1-dev.safetensors, SD3 files without text encoders): diffusers
# then needs the rest from elsewhere, so it is taken from model.config's weights, and a shipped (weightless) config
# is refused up front.


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
    return marked_family(keys)


def missing_components(file: Path, family: str) -> list[str]:
    """The weighted components (vae, text_encoder...) a .safetensors file of `family` has no tensors for ([] for a
    .ckpt or an unreadable file: diffusers then reports what it cannot find)."""
    components = dict(facts(family).checkpoint_components)
    if file.suffix.lower() != ".safetensors" or not components:
        return []
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
    except Exception:
        return []
    return [c for c, prefixes in components.items() if not any(k.startswith(prefixes) for k in keys)]


def components_from_folder(family: Any, file: Path, folder: Path, names: list[str]) -> dict[str, Any]:
    """The components `file` lacks, loaded from the diffusers folder model.config names (its model_index.json
    says each one's class)."""
    import importlib
    import json

    index = json.loads((folder / "model_index.json").read_text())
    out = {}
    for name in names:
        library, cls = index[name]
        try:
            out[name] = getattr(importlib.import_module(library), cls).from_pretrained(
                str(folder), subfolder=name, local_files_only=True
            )
        except Exception as exc:  # no weights there, or unreadable ones: name the folder and the component
            raise ValueError(
                f"model.config: {folder} has no loadable {name} weights ({type(exc).__name__}: {exc}), and "
                f"model.path {file} holds none for it; set model.config to a local diffusers folder of the "
                f"{family.facts.name} model that holds its {', '.join(names)} weights"
            ) from exc
    return out


def convert_single_file(family: Any, file: Path, cache_dir: Path, config: str | None = None) -> Path:
    """The cached diffusers folder for `file`, converting it on first use. Keyed by the file's path, size and
    mtime (and the config folder) so an edited checkpoint is converted again rather than silently reusing the old
    conversion."""
    name = family.facts.name
    if file.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        raise ValueError(
            f"model.path: {file} is neither a diffusers folder nor a single checkpoint file "
            f"({', '.join(SINGLE_FILE_SUFFIXES)})"
        )
    if not hasattr(family.pipeline_class, "from_single_file"):
        raise ValueError(
            f"model.path: {file}: diffusers cannot load family {name!r} from a single file; "
            f"convert it to a diffusers folder and point model.path at that"
        )
    check_fits(family, file, checkpoint_family(file), "checkpoint")
    config, shipped = resolve_config(name, file, config)
    missing = missing_components(file, name)
    if missing and (shipped or config is None):
        where = (
            f"the shipped {Path(config).name} config (configs and tokenizers only) has none to add"
            if shipped
            else "model.config is null"
        )
        raise ValueError(
            f"model.path: {file} holds the {family.denoiser_component} but no weights for "
            f"{', '.join(missing)}, and {where}; set model.config to a local diffusers folder of "
            f"the same {name} model that holds them (its {', '.join(missing)} are loaded from it, the "
            f"{family.denoiser_component} from the file), or use a checkpoint file that includes them"
        )
    if config is not None and not shipped:  # shipped folders hold no weights; tests check them
        try:
            family.check_folder(Path(config))
        except ValueError as err:  # the folder check names model.path; here the folder is model.config
            raise ValueError(str(err).replace("model.path", "model.config", 1)) from None
    st = file.stat()
    ident = f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}" + (f"\0{Path(config).resolve()}" if config else "")
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    target = Path(cache_dir) / f"{name}-single-{file.stem}-{key}"
    return build_once(family, target, lambda tmp: _convert(family, file, tmp, config, missing))


def _convert(family: Any, file: Path, out_dir: Path, config: str | None, missing: list[str]) -> None:
    extra: dict[str, Any] = {"config": str(config)} if config is not None else {}
    if missing and config is not None:
        extra.update(components_from_folder(family, file, Path(config), missing))
    try:
        if config is not None and file.suffix.lower() == ".safetensors":
            denoiser = family.single_file_denoiser(file, Path(config))
            if denoiser is not None:  # the family reads this layout itself (e.g. at any width)
                extra[family.denoiser_component] = denoiser
        pipe = family.pipeline_class.from_single_file(
            str(file), local_files_only=True, **extra, **family.pipeline_load_kwargs()
        )
    except Exception as exc:  # diffusers raises many kinds here; the user needs the file name and the fix
        raise ValueError(
            f"model.path: cannot load {file} as a single-file {family.facts.name!r} checkpoint "
            f"({type(exc).__name__}: {exc}). diffusers needs the pipeline's configs, which cannot be downloaded "
            f"here; set model.config to a shipped config name ({', '.join(SHIPPED_CONFIGS)}) or a local diffusers "
            f"folder of the same model (its configs and tokenizers are read, and the weights of components the "
            f"file lacks), or convert the checkpoint to a diffusers folder where a model hub is "
            f"reachable and point model.path at that folder"
        ) from exc
    pipe.save_pretrained(out_dir, safe_serialization=True)
