"""The weightless pipeline folders shipped in stages/families/configs/ (configs + tokenizers of the released model
sizes), which let an original-layout single checkpoint file load offline without a local diffusers folder.

A shipped folder describes one size of model; a file of another size (an SD2 checkpoint given as SD1.5, an inpainting
UNet with 9 input channels, a pruned or custom-width model) would convert into garbage or fail deep in diffusers, so
the file's shapes of a few telling tensors are compared first and a mismatch names model.config.
"""

from __future__ import annotations

import json
from pathlib import Path

from tuneline.schemas.families import FAMILY_FACTS
from tuneline.schemas.model import SHIPPED_CONFIGS

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
UNET = "model.diffusion_model."


def shapes_file(name: str) -> Path:
    """stages/families/<family>/shipped.json for the family's own config, shipped_<name>.json for a further size."""
    family = SHIPPED_CONFIGS[name]
    return Path(__file__).resolve().parent / family / ("shipped.json" if name == family else f"shipped_{name}.json")


def signature(name: str) -> dict[str, tuple[int, ...]]:
    """Original-layout tensor name -> shape in the released model (shapes_file): the denoiser's first layer
    (latent channels), widths, the depth of the deepest stack, the text encoders' widths."""
    data = json.loads(shapes_file(name).read_text(encoding="utf-8"))
    return {k: tuple(v) for k, v in data["shapes"].items()}


SIGNATURES: dict[str, dict[str, tuple[int, ...]]] = {n: signature(n) for n in SHIPPED_CONFIGS}


def shipped_dir(name: str) -> Path:
    return CONFIGS_DIR / name


def file_shapes(file: Path, keys: list[str]) -> dict[str, tuple[int, ...]] | None:
    """Shapes of `keys` present in the checkpoint, each also looked up under the "model.diffusion_model." prefix
    (None: unreadable). .safetensors reads only the header; a .ckpt is memory-mapped, so neither reads the weights."""

    def found(names) -> dict[str, str]:
        return {k: n for k in keys for n in (k, UNET + k) if n in names}

    try:
        if file.suffix.lower() == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return {k: tuple(f.get_slice(n).get_shape()) for k, n in found(set(f.keys())).items()}
        import torch

        sd = torch.load(str(file), map_location="cpu", mmap=True, weights_only=True)
        sd = sd.get("state_dict", sd) if isinstance(sd, dict) else {}
        return {k: tuple(sd[n].shape) for k, n in found(sd).items() if hasattr(sd[n], "shape")}
    except Exception:  # the caller reports an unreadable file with the way out
        return None


def misfits(file: Path, name: str) -> list[str]:
    """How `file` differs from shipped config `name` ([] = it fits, or it cannot be read: the conversion then
    reports the unreadable file with the way out)."""
    want = SIGNATURES[name]
    got = file_shapes(file, list(want))
    if got is None:
        return []
    return [
        f"{k} is {'missing' if k not in got else list(got[k])} (the shipped {name} has {list(v)})"
        for k, v in want.items()
        if got.get(k) != v
    ]


def resolve_config(family_name: str, file: Path, config: str | None) -> tuple[str | None, bool]:
    """(the model.config folder to convert `file` with, whether it is a shipped one). A shipped name, or null for a
    family that has a shipped folder, must fit the file's shapes; null for another family keeps diffusers' own lookup
    (its Hugging Face cache)."""
    if config is None and family_name not in SIGNATURES:
        return None, False
    if config is not None and config not in SHIPPED_CONFIGS:
        return config, False
    # null: the family's shipped size whose shapes fit (Wan's 1.3B or 14B), else its own for the message
    sizes = [n for n, fam in SHIPPED_CONFIGS.items() if fam == family_name]
    name = config or next((n for n in sizes if not misfits(file, n)), family_name)
    problems = misfits(file, name)
    if problems:
        which = (
            f"model.config: {name} (the shipped config of the released {name} model)"
            if config
            else f"model.config: null uses the shipped {name} config (the released {name} model), which"
        )
        raise ValueError(
            f"{which} does not fit model.path {file}: " + "; ".join(problems[:3]) + _way_out(family_name, file)
        )
    return str(shipped_dir(name)), True


def _way_out(family_name: str, file: Path) -> str:
    """The fix for a file that no shipped size of its family fits: the shipped config of a row of another layout of
    the family (FamilyFacts.variant_of; it trains as that row) when the file fits one, else a local folder."""
    other = next(
        (
            n
            for n, fam in SHIPPED_CONFIGS.items()
            if FAMILY_FACTS[fam].variant_of == family_name and not misfits(file, n)
        ),
        None,
    )
    if other is not None:
        return f". The file fits the shipped {other} config (model.family {family_name} trains it): set model.config {other}"
    return (
        ". Set model.config to a local diffusers folder of this model (its configs and tokenizers are read, not its "
        "weights), or check model.family and model.path"
    )
