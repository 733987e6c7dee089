"""The trained model: full fine-tune or LoRA (peft), precision, gradient checkpointing, and the `final/` output.

Everything here goes through the family adapter or diffusers' own folder format (model_index.json), never a
family name, so every family trains the same way.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

from tuneline.schemas.checks import HALF, precision_problem
from tuneline.schemas.train import TrainConfig
from tuneline.stages.families.common import unwrap
from tuneline.stages.train.adapters import containers, peft_config
from tuneline.stages.train.compile import compile_blocks
from tuneline.stages.train.export import ExportInfo, checkpoint_metadata, exports, save_lora
from tuneline.stages.train.quantize import quantize_base
from tuneline.stages.train.singlefile_export import save_single_file


def autocast_dtype(mixed: str, device: torch.device, dtype: str = "float32", mode: str = "lora") -> torch.dtype | None:
    """The autocast dtype, or None for plain float32. CPU always trains in float32: half-precision convolutions
    there are slow or missing, and the tests' exact-resume guarantee needs deterministic float32. Combinations
    that cannot train are refused naming both fields (tuneline.schemas.checks.precision_problem)."""
    problem = precision_problem(dtype, mixed, mode, device.type)
    if problem:
        raise ValueError(problem)
    if device.type != "cuda":
        return None
    return gpu_autocast(mixed, dtype, torch.cuda.is_bf16_supported())


def gpu_autocast(mixed: str, dtype: str, bf16_supported: bool) -> torch.dtype | None:
    """The dtype a GPU run with train.mixed_precision `mixed` and model.dtype `dtype` autocasts in (None: plain
    float32); the memory planner assumes it too. `auto` computes in a half-precision model.dtype's own type, else
    bf16 where the GPU has it; bf16 or fp16 named win over model.dtype."""
    if mixed == "no":
        return None
    if mixed == "auto":
        if dtype in HALF:
            mixed = HALF[dtype]
        else:
            return torch.bfloat16 if bf16_supported else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed]


def attention_for_training(device: torch.device) -> None:
    """Leaves cuDNN out of scaled-dot-product attention on a CUDA training device. Its fused attention backward
    failed in a FLUX.1 LoRA step at 1024² on an H200 (torch 2.11.0+cu130, cuDNN 9.19): the graph's execute
    reported an error, then an illegal memory access ended the process; with cuDNN left out the same step ran
    (bench/README.md, gpu.py). SDPA then picks flash or memory-efficient attention, as it does on every card
    before Hopper, and falls back to the math kernel for shapes neither serves."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def grad_scaler(dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """fp16 gradients underflow without loss scaling; bf16 and float32 need none (a disabled scaler is a no-op)."""
    return torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)


def lora_config(t: TrainConfig, fam, denoiser: torch.nn.Module):
    """The peft config of train.adapter (stages/train/adapters.py) on the family's targets in `denoiser`, less the
    modules whose output never reaches the loss."""
    den, targets = unwrap(denoiser), fam.lora_target_modules
    return peft_config(t, targets, fam.unused_modules(den, fam.denoiser_component), containers(den, targets))


def freeze_unused(fam, model: torch.nn.Module, component: str) -> None:
    """A full fine-tune keeps the modules whose output never reaches the loss frozen (Family.unused_modules): a
    trained parameter without a gradient stops DDP at its second step."""
    for name in fam.unused_modules(model, component):
        model.get_submodule(name).requires_grad_(False)


def prepare_denoiser(
    fam,
    model_dir: Path,
    t: TrainConfig,
    base_dtype: torch.dtype,
    device: torch.device,
    quantize: str | None = None,
    shards: int = 1,
    load=None,
    expert: str | None = None,
) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]:
    """(denoiser ready to train, its trainable parameters by name). `shards`: the processes FSDP will split the
    model over (1: DDP, every process holds all of it); `load`: how the denoiser is built (default
    fam.load_denoiser, with model.expert `expert`; FSDP's builds a skeleton whose weights each rank loads as its
    shard).

    Full: every weight in float32 (master weights; autocast does the low-precision math). LoRA: the frozen base in
    `base_dtype` to save memory, the adapter weights in float32. Either way the norms and LoRA inputs keep less for
    the backward (tuneline.stages.train.lean).
    """
    torch.manual_seed(t.seed)  # identical LoRA init on every rank (DDP broadcasts rank 0's anyway)
    if load is None:  # a quantized base (LoRA only) is quantized on its way to the device, a component at a time
        place = partial(quantize_base, quantize=quantize, device=device) if quantize else None
        load = partial(fam.load_denoiser, expert=expert, place=place)
    if t.mode == "full":
        fam.check_full_finetune(model_dir, shards)  # a denoiser too large even when split is refused before it loads
        den = load(model_dir, torch.float32, device).requires_grad_(True)
        freeze_unused(fam, den, fam.denoiser_component)
    else:
        den = load(model_dir, base_dtype, device).requires_grad_(False)
        den.add_adapter(lora_config(t, fam, den))
        for p in den.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    from tuneline.stages.train.lean import HALF, lean_activations

    lean_activations(den, t.mode == "lora" and base_dtype in HALF)  # a half base trains under autocast on CUDA
    if t.gradient_checkpointing:
        if not getattr(den, "_supports_gradient_checkpointing", False):
            raise ValueError(f"train.gradient_checkpointing: {type(den).__name__} does not support it; set it false")
        from tuneline.stages.train.offload import offloaded_checkpoint

        den.enable_gradient_checkpointing(offloaded_checkpoint if t.gradient_checkpointing == "offload" else None)
    if t.compile:  # after checkpointing and LoRA are in place, before any wrapping or sharding
        compile_blocks(den, fam.block_stacks(den))
    den.train()
    trainable = {n: p for n, p in den.named_parameters() if p.requires_grad}
    if not trainable:
        raise ValueError(
            f"train.mode {t.mode}: no trainable parameters (LoRA target modules "
            f"{fam.lora_target_modules} not found in {type(den).__name__}?)"
        )
    return den, trainable


def denoiser_component(model_dir: Path, denoiser: torch.nn.Module) -> tuple[str, str]:
    """(pipeline class name, component name of the denoiser) from the folder's model_index.json."""
    index = json.loads((Path(model_dir) / "model_index.json").read_text(encoding="utf-8"))
    cls = type(unwrap(denoiser)).__name__
    for name, entry in index.items():
        if isinstance(entry, list) and len(entry) == 2 and entry[1] == cls:
            return index["_class_name"], name
    raise ValueError(f"{model_dir}/model_index.json lists no {cls} component")


def save_final(
    fam,
    model_dir: Path,
    denoiser: torch.nn.Module,
    t: TrainConfig,
    out: Path,
    info: ExportInfo | None = None,
    text=None,
) -> list[dict]:
    """`final/`: a pipeline folder for DiffusionPipeline.from_pretrained (full), or LoRA weights in the layouts
    `train.lora_format` names (stages/train/export.py), with `info` in their headers. Returns the manifest's
    `exports` entries (paths relative to `out`'s parent, the artifact directory). `text`: the trained text
    encoders of train.text_encoder_lora (stages/train/textlora.py), whose LoRA goes into the same files."""
    if t.mode == "full":
        fam.save_pipeline(model_dir, unwrap(denoiser), out)
        if getattr(t, "export_single_file", False):
            save_single_file(fam, out, checkpoint_metadata(info, fam.facts.name) if info else {})
        return exports(out.parent, out, t.mode)
    from peft.utils import get_peft_model_state_dict

    suffixes = fam.lora_suffixes(unwrap(denoiser))
    for component, part in fam.denoiser_parts(unwrap(denoiser)).items():
        # Each timestep expert's LoRA in files of its own (..._high_noise, ..._low_noise), keyed as the denoiser's
        # (diffusers' loader puts a file into another expert by a load_lora_weights argument: lora_load_kwargs).
        pipe_name, comp = denoiser_component(model_dir, part)
        layers = {
            k: v.detach().to("cpu", torch.float32).contiguous() for k, v in get_peft_model_state_dict(part).items()
        }
        meta = lora_config(t, fam, part).to_dict()
        meta["target_modules"] = sorted(meta["target_modules"])
        suffix = f"_{suffixes[component]}" if component in suffixes else ""
        save_lora(fam, pipe_name, comp, part, layers, meta, t, out, info, text, suffix=suffix)
    return exports(out.parent, out, t.mode)
