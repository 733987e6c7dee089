"""What `final/` holds and how it is listed: LoRA files in diffusers' and kohya's layouts with training metadata in
their headers, and the `exports` entries of the train manifest.

Files (under the train artifact's `final/`):
- `pytorch_lora_weights.safetensors`: diffusers/peft layout, for `pipe.load_lora_weights(final_dir)`.
- `lora_kohya.safetensors`: kohya sd-scripts layout (stages/train/kohya.py), for ComfyUI `models/loras`,
  A1111/Forge `models/Lora`; for train.adapter lokr/loha/dora the LyCORIS layout (stages/train/adapters.py), the
  only file for lokr/loha, which diffusers cannot load.
- a family with timestep experts (FamilyFacts.experts): each LoRA file once per trained expert, its stem suffixed
  with the expert's name (`pytorch_lora_weights_high_noise.safetensors`, `lora_kohya_low_noise.safetensors`);
- a full fine-tune: the diffusers pipeline folder `final/` itself, and with train.export_single_file
  `final/model.safetensors`, the whole model in the original (LDM) layout (stages/train/singlefile_export.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from tuneline.schemas.families import FAMILY_FACTS
from tuneline.stages.common.hashing import file_sha256
from tuneline.stages.train import adapters, kohya, textlora
from tuneline.stages.train.singlefile_export import SINGLE_FILE

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' save/load_lora_weights use
KOHYA_FILE = "lora_kohya.safetensors"
LAYOUTS = ((DIFFUSERS_FILE, "diffusers"), (KOHYA_FILE, "kohya"))


def _header_facts(family: str) -> tuple[str, str, str]:
    """(kohya's ss_base_model_version, the SAI model spec architecture (modelspec.architecture is "<arch>/lora" for a
    LoRA), its original implementation) from the family's row in schemas/families.py; the name where none is set."""
    f = FAMILY_FACTS.get(family)
    if f is None:
        return family, family, "diffusers"
    return f.kohya_base_version or family, f.modelspec_arch or family, f.modelspec_impl


@dataclass(frozen=True)
class ExportInfo:
    """What the train stage knows about a run that goes into the files' headers (no paths)."""

    train_version: str
    base_identity: str
    steps: int
    num_train_images: int
    resolution: int  # the bucket edge in pixels
    started_at: float  # Unix time training started
    title: str = "tuneline LoRA"
    tag_frequency: dict[str, int] = field(default_factory=dict)  # only with train.metadata_captions


def resolution_edge(resolution: float, resolution_type: str) -> int:
    """buckets.resolution as a square edge in pixels (area: megapixels of 1024 x 1024)."""
    return round(math.sqrt(resolution) * 1024) if resolution_type == "area" else round(resolution)


def metadata(info: ExportInfo, t, family: str, fmt: str) -> dict[str, str]:
    """The safetensors header metadata (strings only) of a LoRA file in format `fmt`."""
    alpha = t.lora_alpha or t.lora_rank
    started = datetime.fromtimestamp(info.started_at, UTC)
    module, algo = adapters.NETWORK[adapters.adapter_of(t)]
    meta = {
        "ss_network_module": module,
        "ss_network_dim": str(t.lora_rank),
        "ss_network_alpha": str(alpha),
        "ss_base_model_version": _header_facts(family)[0],
        "ss_v2": "False",
        "ss_resolution": f"({info.resolution}, {info.resolution})",
        "ss_steps": str(info.steps),
        "ss_max_train_steps": str(t.steps),
        "ss_num_train_images": str(info.num_train_images),
        "ss_training_started_at": repr(float(info.started_at)),
        "ss_learning_rate": str(t.learning_rate),
        "ss_lr_scheduler": t.lr_schedule,
        "ss_seed": str(t.seed),
        "ss_mixed_precision": t.mixed_precision,
        "ss_batch_size_per_device": str(t.batch_size),
        "ss_gradient_accumulation_steps": str(t.grad_accumulation),
        "ss_output_name": info.title,
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": f"{_header_facts(family)[1]}/lora",
        "modelspec.implementation": "diffusers" if fmt == "diffusers" else _header_facts(family)[2],
        "modelspec.title": info.title,
        "modelspec.resolution": f"{info.resolution}x{info.resolution}",
        "modelspec.date": started.isoformat(timespec="seconds"),
        "modelspec.author": "tuneline",
        "tuneline.train_version": info.train_version,
        "tuneline.base_identity": info.base_identity,
        "tuneline.lora_format": fmt,
    }
    if algo:  # kohya's network_args as it writes them (LyCORIS algo, its factor; DoRA's weight decomposition)
        args = (
            {"algo": algo, **({"factor": str(t.lokr_factor)} if algo == "lokr" else {})}
            if algo != "dora"
            else {"dora_wd": "True"}
        )
        meta["ss_network_args"] = json.dumps(args, sort_keys=True)
    if t.metadata_captions and info.tag_frequency:
        meta["ss_tag_frequency"] = json.dumps({"train": info.tag_frequency}, sort_keys=True)
    return meta


def checkpoint_metadata(info: ExportInfo, family: str) -> dict[str, str]:
    """The header of a full model's single file: the SAI model spec and ours (no LoRA keys)."""
    started = datetime.fromtimestamp(info.started_at, UTC)
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": _header_facts(family)[1],
        "modelspec.implementation": _header_facts(family)[2],
        "modelspec.title": info.title,
        "modelspec.resolution": f"{info.resolution}x{info.resolution}",
        "modelspec.date": started.isoformat(timespec="seconds"),
        "modelspec.author": "tuneline",
        "ss_base_model_version": _header_facts(family)[0],
        "ss_steps": str(info.steps),
        "ss_num_train_images": str(info.num_train_images),
        "ss_training_started_at": repr(float(info.started_at)),
        "tuneline.train_version": info.train_version,
        "tuneline.base_identity": info.base_identity,
    }


def add_metadata(path: Path, meta: dict[str, str]) -> None:
    """Rewrite a safetensors file with `meta` merged into its header (LoRA files are small)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        old = f.metadata() or {}
    save_file(tensors, str(path), metadata={**old, **meta})


def save_lora(
    fam,
    pipe_name: str,
    comp: str,
    den: torch.nn.Module,
    layers: dict[str, torch.Tensor],
    adapter_meta: dict,
    t,
    out: Path,
    info: ExportInfo | None,
    text=None,
    suffix: str = "",
) -> None:
    """Write the LoRA file(s) `train.lora_format` asks for into `out` (final/); with `text` (trained text
    encoders, train.text_encoder_lora) their LoRA too: `text_encoder.`/`text_encoder_2.` keys in the diffusers
    file, kohya's `lora_te_`/`lora_te1_`/`lora_te2_` modules in the kohya one. `suffix` ends the files' stems (a
    timestep expert's: `_high_noise`)."""
    fmt = getattr(t, "lora_format", "both")
    out.mkdir(parents=True, exist_ok=True)
    if adapters.adapter_of(t) not in adapters.DIFFUSERS_LOADS:
        fmt = "kohya"  # no diffusers loader: the LyCORIS file only (the manifest's not_exported says so)
    te_layers = text.layers() if text is not None else {}
    if fmt in ("diffusers", "both"):
        path = out / named(DIFFUSERS_FILE, suffix)
        _save_diffusers(fam, pipe_name, comp, layers, adapter_meta, t, path, info, text, te_layers)
    if fmt in ("kohya", "both"):
        _save_kohya(fam, den, layers, adapter_meta, te_layers, t, out / named(KOHYA_FILE, suffix), info)


def _save_diffusers(fam, pipe_name, comp, layers, adapter_meta, t, path: Path, info, text, te_layers) -> None:
    """The diffusers file: the pipeline's save_lora_weights, the text encoders' LoRA beside the denoiser's."""
    import diffusers

    te_kwargs = {}
    for name, state in te_layers.items():
        te_meta = text.configs[name].to_dict()
        te_meta["target_modules"] = sorted(te_meta["target_modules"])
        te_kwargs |= {f"{name}_lora_layers": state, f"{name}_lora_adapter_metadata": te_meta}
    getattr(diffusers, pipe_name).save_lora_weights(
        path.parent,
        weight_name=path.name,
        **{f"{comp}_lora_layers": layers, f"{comp}_lora_adapter_metadata": adapter_meta},
        **te_kwargs,
    )
    if info is not None:
        add_metadata(path, metadata(info, t, fam.facts.name, "diffusers"))


def _save_kohya(fam, den, layers, adapter_meta, te_layers, t, path: Path, info) -> None:
    """The kohya/ComfyUI file (a LyCORIS one for the other adapters)."""
    from safetensors.torch import save_file

    family, adapter = fam.facts.name, adapters.adapter_of(t)
    # A family whose ComfyUI loader reads its own layout writes it itself (Family.comfy_lora_state).
    if adapter != "lora":
        state = adapters.to_lycoris(family, den, layers, t)
    else:
        state = fam.comfy_lora_state(den, layers, adapter_meta["lora_alpha"])
        if state is None:
            state = kohya.to_kohya(family, den, layers, adapter_meta["lora_alpha"])
    if te_layers:
        state |= textlora.kohya_state(family, te_layers, adapter_meta["lora_alpha"])
    meta = {"format": "pt", **(metadata(info, t, family, "kohya") if info is not None else {})}
    save_file(state, str(path), metadata=meta)


def named(file: str, suffix: str) -> str:
    """A LoRA file's name with `suffix` (a timestep expert's) at the end of its stem."""
    stem, ext = file.rsplit(".", 1)
    return f"{stem}{suffix}.{ext}"


def lora_parts(family: str, final: Path) -> list[tuple[str | None, str]]:
    """(pipeline component, file suffix) of each LoRA in final/: one per trained timestep expert
    (FamilyFacts.experts), else (None, "") for the denoiser's."""
    experts = FAMILY_FACTS[family].experts if family in FAMILY_FACTS else ()
    found = [
        (comp, f"_{name}")
        for comp, name in experts
        if any((final / named(f, f"_{name}")).is_file() for f in (DIFFUSERS_FILE, KOHYA_FILE))
    ]
    return found or [(None, "")]


def load_lora(pipe, family: str, final: Path) -> None:
    """Apply final/'s adapter(s) to a diffusers pipeline: load_lora_weights for LoRA/DoRA files; a lokr/loha file
    (no diffusers loader) is merged into the denoiser's weights with ComfyUI's formulas (stages/train/adapters.py).
    A run of timestep experts has files per expert, each loaded into its component."""
    from safetensors import safe_open

    from tuneline.stages.families.registry import get_family

    for comp, suffix in lora_parts(family, final):
        folder, weight_name = lora_source(final, suffix)
        if weight_name == named(KOHYA_FILE, suffix):
            with safe_open(str(folder / weight_name), framework="pt") as f:
                if any(".lokr_" in k or ".hada_" in k for k in f.keys()):
                    den = pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
                    den = getattr(pipe, comp) if comp else den
                    adapters.apply_file(family, den, {k: f.get_tensor(k) for k in f.keys()})
                    continue
        kwargs = get_family(family).lora_load_kwargs(comp) if comp else {}
        pipe.load_lora_weights(folder, **({"weight_name": weight_name} if weight_name else {}), **kwargs)


def lora_loader(family: str, final: Path):
    """Renderer.load's `adapt` for a LoRA run's final/: the pipeline gets its weights through load_lora."""
    return lambda pipe: load_lora(pipe, family, final)


def lora_source(final: Path, suffix: str = "") -> tuple[Path, str | None]:
    """(folder, weight_name) for load_lora_weights: the diffusers file when written, else the kohya one (a
    timestep expert's, with its `suffix`, always by name)."""
    diffusers_file, kohya_file = named(DIFFUSERS_FILE, suffix), named(KOHYA_FILE, suffix)
    if (final / diffusers_file).is_file() or not (final / kohya_file).is_file():
        return final, diffusers_file if suffix else None
    return final, kohya_file


def exports(root: Path, final: Path, mode: str) -> list[dict]:
    """Manifest `exports` entries, paths relative to the artifact directory `root`."""
    rel = final.relative_to(root).as_posix()
    if mode == "full":
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        out = [{"file": rel, "format": "diffusers", "bytes": size, "sha256": None}]
        single = final / SINGLE_FILE
        if single.is_file():
            out.append(
                {
                    "file": f"{rel}/{SINGLE_FILE}",
                    "format": "single-file",
                    "bytes": single.stat().st_size,
                    "sha256": file_sha256(single),
                }
            )
        return out
    # Each file once per trained timestep expert (named(..., suffix)), or once
    found = [(f.name, fmt) for file, fmt in LAYOUTS for f in sorted(final.glob(named(file, "*")))]
    return [
        {
            "file": f"{rel}/{name}",
            "format": fmt,
            "bytes": (final / name).stat().st_size,
            "sha256": file_sha256(final / name),
        }
        for name, fmt in found
        if (final / name).is_file()
    ]
