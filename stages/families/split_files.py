"""Split files: a transformer-only `model.path` (the `diffusion_models/` file ComfyUI distributes) with the text
encoder and VAE as separate files (`model.text_encoder_path`, `model.vae_path`), assembled once into a diffusers
folder in the cache.

The folder's configs, tokenizers and scheduler come from `model.config` (a local diffusers folder of the model, or
the family's shipped weightless config); each given file replaces its component's weights, and components no file
is given for keep that folder's weights. Files may be fp8 (tuneline.stages.families.fp8 dequantizes them). A
component file in the diffusers/transformers layout is loaded as it is; a denoiser or VAE in its original layout goes
through diffusers' single-file converter for the class, so no key map is kept here. A model of several timestep
experts takes one file per expert (Family.denoiser_files says which file fills which expert).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tuneline.schemas.families import FAMILY_FACTS
from tuneline.stages.families.fp8 import read_weights

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
WEIGHTS = (".safetensors", ".bin")
TOKENIZER_TENSOR = "spiece_model"


def checkpoint_family(keys: list[str]) -> str | None:
    """The family whose checkpoint_marker the tensor names have; where several match (a FLUX.2 file also has Flux.1's
    `double_blocks.`), the longest marker, the most specific, wins."""
    names = [k.removeprefix(p) for k in keys for p in PREFIXES if k.startswith(p)] + list(keys)
    hits = [
        (len(f.checkpoint_marker), n)
        for n, f in FAMILY_FACTS.items()
        if f.released and f.checkpoint_marker and any(k.startswith(f.checkpoint_marker) for k in names)
    ]
    return max(hits, key=lambda h: h[0])[1] if hits else None  # ties: the first row (FLUX.2 [dev] before [klein])


def check_fits(family: Any, file: Path, found: str | None, kind: str) -> None:
    """Refuse a file whose tensor names are another family's (`found`, from checkpoint_family); `kind` names what
    the file is (a checkpoint, a transformer file)."""
    name = family.facts.name
    if found is not None and FAMILY_FACTS[found].checkpoint_marker != family.facts.checkpoint_marker:
        raise ValueError(
            f"model.path: {file} is a {found} {kind} (its tensor names are {found}'s original layout) but "
            f"model.family is {name}; set model.family {found}, or point model.path at a {name} {kind}"
        )


def _file_ident(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"


def assembled_dir(
    family: Any, denoisers: dict[str, Path], cache_dir: Path, folder: Path, parts: dict[str, Path]
) -> Path:
    """Keyed by every file and the folder; further experts' files count as parts, so a one-denoiser model's key is
    its transformer file's, the folder and its parts."""
    file = denoisers[family.denoiser_component]
    others = {c: p for c, p in denoisers.items() if c != family.denoiser_component} | parts
    ident = "\0".join([_file_ident(file), str(folder.resolve())] + [f"{c}={_file_ident(p)}" for c, p in others.items()])
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{family.facts.name}-split-{file.stem}-{key}"


def field_of(family: Any, comp: str) -> str:
    """The config field that gives component `comp`'s file (every timestep expert's comes with model.path)."""
    if comp == "vae":
        return "model.vae_path"
    experts = {family.denoiser_component, *(c for c, _ in family.facts.experts)}
    return "model.path" if comp in experts else "model.text_encoder_path"


def convert_split_files(
    family: Any,
    file: Path,
    cache_dir: Path,
    config: str | None,
    text_encoder_path: str | None = None,
    vae_path: str | None = None,
    expert: str | None = None,
) -> Path:
    """model.path `file` (transformer only, or with model.text_encoder_path / model.vae_path beside it) as a
    diffusers folder in `cache_dir`; `expert` (model.expert) tells a model of timestep experts which files the run
    needs."""
    from tuneline.stages.families.shipped import resolve_config

    parts = part_files(family, text_encoder_path, vae_path)
    folder, _ = resolve_config(family.facts.name, file, config)
    if folder is None or not (Path(folder) / "model_index.json").is_file():
        where = "is null and the family ships no config" if folder is None else f"{folder} has no model_index.json"
        raise ValueError(
            f"model.config {where}: model.path {file} is a single transformer file, whose configs, tokenizers and "
            f"scheduler must come from a diffusers folder; set model.config to a local diffusers folder of the "
            f"{family.facts.name} model"
        )
    denoisers = family.denoiser_files(file, Path(folder), expert)
    check_configs(family, Path(folder), denoisers, parts)
    return assemble(family, denoisers, cache_dir, Path(folder), parts)


def check_configs(family: Any, folder: Path, denoisers: dict[str, Path], parts: dict[str, Path]) -> None:
    """Refuse, before any weights are read, a folder without the config of a component a file is given for (e.g. a
    shipped config, which holds no text encoder)."""
    for comp in (*denoisers, *parts):
        if not (folder / comp / "config.json").is_file():
            field = field_of(family, comp)
            raise ValueError(
                f"{field}: model.config {folder} has no {comp}/config.json to build the {comp} from; set "
                f"model.config to a local diffusers folder of the {family.facts.name} model (its configs and "
                f"tokenizers are read, not its weights)"
            )


def part_files(family: Any, text_encoder_path: str | None, vae_path: str | None) -> dict[str, Path]:
    """component -> file for the separate files given (the family must have exactly one text encoder)."""
    parts: dict[str, Path] = {}
    if text_encoder_path is not None:
        if len(family.text_components) != 1:
            raise ValueError(
                f"model.text_encoder_path: family {family.facts.name} has {len(family.text_components)} text "
                f"encoders ({', '.join(family.text_components)}); give them through model.config (a local "
                f"diffusers folder holding their weights) and set model.text_encoder_path null"
            )
        parts[family.text_components[0]] = Path(text_encoder_path).expanduser()
    if vae_path is not None:
        parts["vae"] = Path(vae_path).expanduser()
    for comp, p in parts.items():
        if not p.is_file():
            field = "model.vae_path" if comp == "vae" else "model.text_encoder_path"
            raise ValueError(f"{field}: {p} is not a file; give the .safetensors file of the model's {comp}")
    return parts


def assemble(family: Any, denoisers: dict[str, Path], cache_dir: Path, folder: Path, parts: dict[str, Path]) -> Path:
    """The cached diffusers folder for the `denoisers` files + `parts` over the configs (and remaining weights) of
    `folder`."""
    target = assembled_dir(family, denoisers, cache_dir, folder, parts)

    def build(tmp: Path) -> None:
        _copy_folder(folder, tmp)
        done: dict[Path, str] = {}
        for comp, path in {**denoisers, **parts}.items():
            if path in done:  # one file for two components (a one-expert run's stand-in): converted once
                _link_weights(tmp / done[path], tmp / comp)
            else:
                _replace(family, comp, path, tmp)
            done.setdefault(path, comp)
        _check_weights(family, tmp, folder)

    return build_once(family, target, build)


def build_once(family: Any, target: Path, build) -> Path:
    """`target` when it is already built (checked), else `build(tmp)` in a temporary folder beside it, checked and
    renamed into place: a killed build leaves no half folder, and of two processes building it one copy wins."""
    if target.is_dir():
        family.check_folder(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        family.check_folder(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _copy_folder(folder: Path, out: Path) -> None:
    def link(src: str, dst: str) -> None:  # weights are hard-linked where the filesystem allows (no 2nd copy)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(folder, out, dirs_exist_ok=True, copy_function=link)


def _weight_files(comp_dir: Path) -> list[Path]:
    return [p for p in comp_dir.iterdir() if p.suffix in WEIGHTS or p.name.endswith(".index.json")]


def _link_weights(src: Path, dst: Path) -> None:
    """`dst` holds `src`'s weights (hard-linked where the filesystem allows); its own config stays."""
    for p in _weight_files(dst):
        p.unlink()
    for p in _weight_files(src):
        try:
            os.link(p, dst / p.name)
        except OSError:
            shutil.copy2(p, dst / p.name)


def _check_weights(family: Any, out: Path, folder: Path) -> None:
    index = json.loads((out / "model_index.json").read_text())
    for comp, spec in index.items():
        if not isinstance(spec, list) or spec[0] is None or "tokenizer" in comp or "scheduler" in comp:
            continue
        if comp.endswith("processor") or not (out / comp / "config.json").is_file():
            continue
        if not any(p.suffix in WEIGHTS for p in (out / comp).iterdir()):
            field = field_of(family, comp)
            raise ValueError(
                f"{field}: no {comp} weights: model.config {folder} has none (a weightless config); set {field} "
                f"to the {comp} file, or model.config to a local diffusers folder holding them"
            )


def _component_class(out: Path, comp: str) -> type:
    """The component's class as the folder's model_index.json names it (pipelines type some only as a base class,
    e.g. PreTrainedModel)."""
    import importlib

    library, cls = json.loads((out / "model_index.json").read_text())[comp]
    return getattr(importlib.import_module(library), cls)


def _replace(family: Any, comp: str, path: Path, out: Path) -> None:
    field = field_of(family, comp)
    sd = read_weights(path, field)
    # ComfyUI's T5/UMT5 files use transformers' names and may carry their SentencePiece tokenizer as a byte tensor
    # (`spiece_model`, comfy/sd.py): the tokenizer comes from model.config, so it is not a weight.
    sd.pop(TOKENIZER_TENSOR, None)
    if field == "model.path":
        check_fits(family, path, checkpoint_family(list(sd)), "transformer file")
        sd = {next((k.removeprefix(p) for p in PREFIXES if k.startswith(p)), k): v for k, v in sd.items()}
    cls = _component_class(out, comp)
    dtype = _dtype(sd)
    model = _load_named(cls, out / comp, sd, dtype)
    via = family.single_file_layouts.get(comp)
    if model is None and via is not None:  # another class's converter reads this layout (same module names)
        from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

        convert = SINGLE_FILE_LOADABLE_CLASSES[via]["checkpoint_mapping_fn"]
        model = _load_named(cls, out / comp, convert(checkpoint=dict(sd)), dtype)
    if model is None:
        model = _load_converted(cls, out, comp, sd, dtype, field, path)
    for p in _weight_files(out / comp):
        p.unlink()
    model.save_pretrained(out / comp, safe_serialization=True)


def _dtype(sd: dict[str, torch.Tensor]) -> torch.dtype:
    kinds = [v.dtype for v in sd.values() if v.is_floating_point()]
    return max(set(kinds), key=kinds.count) if kinds else torch.float32


def _load_named(cls: type, comp_dir: Path, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> Any | None:
    """The component when the file uses the library's own names (those `save_pretrained` writes, or legacy names
    transformers still maps), else None."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(dir=comp_dir.parent) as d:
        shutil.copy2(comp_dir / "config.json", Path(d) / "config.json")
        is_diffusers = cls.__module__.startswith("diffusers")
        name = "diffusion_pytorch_model.safetensors" if is_diffusers else "model.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(Path(d) / name))
        kw = {"torch_dtype": dtype} if is_diffusers else {"dtype": dtype}
        try:
            model, info = cls.from_pretrained(d, output_loading_info=True, **kw)
        except Exception:  # shapes or names that are not this library's: the converter (or the refusal) follows
            return None
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        missing = [k for k in info.get("missing_keys", []) if k not in tied]
        if missing or info.get("unexpected_keys") or info.get("mismatched_keys"):
            return None
        return model


def _load_converted(
    cls: type, out: Path, comp: str, sd: dict[str, torch.Tensor], dtype: torch.dtype, field: str, path: Path
) -> Any:
    """The component through diffusers' single-file converter for its class (original checkpoint layouts)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    if cls.__name__ not in SINGLE_FILE_LOADABLE_CLASSES:
        raise ValueError(
            f"{field}: {path}'s tensor names are not those of {cls.__name__} (the {comp} of this family), and "
            f"diffusers has no converter for another layout of it; give the {comp} in the diffusers layout "
            f"(a diffusers folder's {comp}/ weights) or check the file"
        )
    try:
        model = cls.from_single_file(
            dict(sd), config=str(out), subfolder=comp, local_files_only=True, torch_dtype=dtype
        )
    except Exception as exc:  # diffusers raises many kinds on a foreign layout; name the file and the fix
        raise ValueError(
            f"{field}: cannot read {path} as the {comp} ({cls.__name__}) of this family "
            f"({type(exc).__name__}: {exc}); check that the file is this model's {comp} and model.family"
        ) from exc
    empty = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if empty:
        raise ValueError(
            f"{field}: {path} has no tensors for {len(empty)} {cls.__name__} weights (e.g. {empty[0]}): it is not "
            f"a whole {comp} of this model; check model.family and the file"
        )
    return model
