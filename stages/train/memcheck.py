"""The memory plan before training (train.memory_check: refuse | warn | off), and what the plan
(tuneline.stages.train.memplan) adds around the training step: the models in-training validation loads on every
rank that renders.

DDP's gradient buckets add nothing: `collectives.wrap` builds DDP with gradient_as_bucket_view=True, so each
gradient is a view into its bucket and the plan's gradients term is the buckets.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VAE = "vae"
DECODER_ONLY = ("encoder.", "quant_conv.")  # rendering drops the VAE encoder (renderer.Renderer.load)


def stored_params(folder: Path, skip: tuple[str, ...] = ()) -> int | None:
    """Parameters of the safetensors weights in `folder` (headers only: nothing is loaded), or None when the
    folder holds none (a shipped weightless config)."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__" and not name.startswith(skip):
                n = 1
                for d in meta["shape"]:
                    n *= d
                total += n
    return total


def meta_params(fam, model_dir: Path, component: str, skip: tuple[str, ...] = ()) -> int:
    """Parameters of a component built from its config on the meta device (diffusers or transformers class)."""
    cls = fam.pipeline_class._get_signature_types()[component][0]
    with torch.device("meta"):
        if hasattr(cls, "load_config"):
            model = cls.from_config(cls.load_config(model_dir, subfolder=component))
        else:
            model = cls(cls.config_class.from_pretrained(Path(model_dir) / component))
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith(skip))


def render_params(fam, model_dir: Path, idle: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """(parameters of the VAE decoder, the text encoders and the `idle` denoiser components (timestep experts the
    run does not hold) a render loads, the components whose folder has neither weights nor a config to size them:
    the shipped configs of the newer families carry no text encoder)."""
    total, unsized = 0, []
    for comp, skip in [(VAE, DECODER_ONLY), *[(c, ()) for c in (*fam.text_components, *idle)]]:
        n = stored_params(Path(model_dir) / comp, skip)
        if n is None and not (Path(model_dir) / comp / "config.json").is_file():
            unsized.append(comp)
            continue
        total += n if n is not None else meta_params(fam, model_dir, comp, skip)
    return total, unsized


def render_models_bytes(fam, model_dir: Path, dtype: torch.dtype) -> int:
    """Bytes of the VAE decoder and the text encoders at the render's dtype."""
    return render_params(fam, model_dir)[0] * torch.empty(0, dtype=dtype).element_size()


def check_before_training(ctx, model_dir: Path, device: torch.device) -> dict | None:
    """The train stage's plan, logged before any worker starts; on a GPU a plan that does not fit is refused
    here (train.memory_check refuse), naming the settings that would fit, or only warned of (warn); off makes
    no plan. Returns the plan for the manifest (None when it could not be made: planning never stops a run
    that would otherwise train)."""
    from tuneline.stages.train.memplan import plan

    check = ctx.cfg.train.memory_check
    if check == "off":
        ctx.log.info("train: no memory plan (train.memory_check off)")
        return None
    try:
        p = plan(ctx.cfg, model_dir, device)
    except Exception as err:  # noqa: BLE001 - a planning gap must not block training
        ctx.log.warning("train: no memory plan (%s: %s)", type(err).__name__, err)
        return None
    ctx.log.info("%s", p.text())
    return enforce(p, check, ctx.log)


def enforce(p, check: str, log) -> dict:
    """Refuse (`refuse`) or warn of (`warn`) a plan that does not fit; the plan for the manifest otherwise."""
    from tuneline.stages.train.memplan import GIB

    if not p.fits:
        fixes = "; ".join(p.fixes) or "none of the planned settings fits: use a GPU with more memory"
        msg = (
            f"train: the planned peak of {p.total / GIB:.2f} GiB per process does not fit the "
            f"{p.free / GIB:.2f} GiB free on {p.where}; settings that would fit: {fixes} "
            f"(`tuneline plan CONFIG` shows the plan"
        )
        if check == "refuse":
            raise ValueError(msg + "; train.memory_check: warn trains anyway)")
        log.warning("%s", msg + "; training anyway: train.memory_check is warn)")
    return p.as_json()


def gpu_figures(cfg, model_dir: Path, step) -> dict:
    """For the GPU benchmark: the plan on this CUDA device beside the measured peak of `step()` (one or more
    training steps the caller runs), in bytes; None where no CUDA device is visible."""
    if not torch.cuda.is_available():
        return {"planned": None, "measured": None}
    from tuneline.stages.train.memplan import plan

    device = torch.device("cuda")
    planned = plan(cfg, model_dir, device).total
    torch.cuda.reset_peak_memory_stats(device)
    step()
    return {
        "planned": planned,
        "measured": torch.cuda.max_memory_allocated(device),
        "ratio": torch.cuda.max_memory_allocated(device) / planned,
    }
