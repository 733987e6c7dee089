"""Cross-field config rules, the ones that span sections or need family facts. Each problem names every field
involved and the fix.

PipelineConfig's model validator runs them (schemas/config.py), so every way a config is built (the CLI's YAML, the
Prefect UI form, `PipelineConfig.model_validate`) refuses the same configs with the same message. Checks collect
problems instead of stopping at the first, so one load reports everything to fix. Single-field rules and rules
within one section live in the section schemas (e.g. fp8 in schemas/model.py, bfloat16 storage in schemas/text.py).
A new cross-section rule is one more function in RULES.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from tuneline.schemas.expert_checks import expert_eval, experts
from tuneline.schemas.families import FamilyFacts, facts, family_list

if TYPE_CHECKING:  # annotations only: config.py imports this module, never the other way round
    from tuneline.schemas.config import PipelineConfig

# train.export_single_file: stages/train/singlefile_export.py writes these (their schemas/families.py rows say so).
SINGLE_FILE_FAMILIES = family_list(lambda f: f.single_file_export)
# train.text_encoder_lora: the families whose rows say their adapters train a text-encoder LoRA.
TEXT_ENCODER_LORA_FAMILIES = family_list(lambda f: f.text_encoder_lora)
FLOW_FAMILIES = family_list(lambda f: f.prediction == "flow_matching")
MEGAPIXEL_EDGE = 1024  # resolution_type area: 1.0 = 1024 x 1024 pixels (docs/design.md)
# An area resolution above this many megapixels is almost surely a pixel edge written with the wrong unit.
MAX_AREA_MEGAPIXELS = 16.0
# No family trains or renders an edge past this (64 megapixels square); above it a run dies allocating, minutes in.
MAX_EDGE = 8192
# host:port or [ipv6]:port, as torchrun's --rdzv_endpoint takes it.
ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def problems(cfg: PipelineConfig) -> list[str]:
    """Every cross-field problem of a config whose sections are each valid; empty when it is consistent."""
    fam = facts(cfg.model.family)
    out: list[str] = []
    for rule in RULES:
        out += rule(cfg, fam)
    return out


def _alignment_source(cfg: PipelineConfig, fam: FamilyFacts) -> tuple[int, str]:
    align = cfg.buckets.alignment
    if align is not None:
        return align, f"buckets.alignment {align}"
    return fam.alignment, f"the alignment of model.family {fam.name}"


def _alignment(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    align = cfg.buckets.alignment
    if align is None or align % fam.alignment == 0:
        return []
    return [
        f"buckets.alignment: {align} is not a multiple of {fam.alignment}, the requirement of model.family "
        f"{fam.name} (VAE factor {fam.vae_factor} x patch {fam.patch_size}); use a multiple of "
        f"{fam.alignment} or null for automatic"
    ]


def _edge_problem(
    res: float, rtype: str, align: int, align_src: str, res_key: str, type_key: str, unit_key: str
) -> str | None:
    """Why a resolution in its unit cannot be meant as given (None when plausible); `type_key` is the field the
    unit comes from, `unit_key` the one to change. The size function rounds any edge up to one alignment unit,
    so without this a unit mistake would silently train or render at a tiny size."""
    if rtype == "area" and res > MAX_AREA_MEGAPIXELS:
        return (
            f"{res_key} {res:g} with {type_key} area means {res:g} megapixels (about "
            f"{math.sqrt(res) * MEGAPIXEL_EDGE:.0f} px square); area takes megapixels (1.0 = 1024x1024): did "
            f"you mean {unit_key} pixel?"
        )
    edge = math.sqrt(res) * MEGAPIXEL_EDGE if rtype == "area" else res
    if edge > MAX_EDGE:
        return (
            f"{res_key} {res:g} with {type_key} {rtype} is a {edge:.0f} px edge, past the {MAX_EDGE} px any "
            f"family trains or renders at; lower {res_key}"
        )
    if edge >= align:
        return None
    hint = f" Did you mean {unit_key} area (1.0 = 1024x1024)?" if rtype != "area" and res <= 16 else ""
    return (
        f"{res_key} {res:g} with {type_key} {rtype} is a {edge:.0f} px edge, smaller than one alignment unit "
        f"({align} px, {align_src}); raise {res_key}.{hint}"
    )


def _bucket_resolution(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    align, src = _alignment_source(cfg, fam)
    b = cfg.buckets
    out = [
        _edge_problem(
            b.resolution,
            b.resolution_type,
            align,
            src,
            "buckets.resolution",
            "buckets.resolution_type",
            "buckets.resolution_type",
        )
    ]
    out += [
        _edge_problem(
            r,
            b.resolution_type,
            align,
            src,
            f"buckets.resolutions.{i}",
            "buckets.resolution_type",
            "buckets.resolution_type",
        )
        for i, r in enumerate(b.resolutions or ())
        if r != b.resolution
    ]
    return [p for p in out if p]


def _validate_resolution(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    v, b = cfg.validate_, cfg.buckets
    if v.resolution is None and v.resolution_type is None:
        return []  # renders at the buckets' size, checked above
    if v.resolution is None and v.resolution_type != b.resolution_type:
        return [
            f"validate.resolution_type {v.resolution_type} is set but validate.resolution is null, so "
            f"buckets.resolution {b.resolution:g} (in buckets.resolution_type {b.resolution_type} units) would "
            f"be read as {v.resolution_type}; set validate.resolution too, or drop validate.resolution_type"
        ]
    align, src = _alignment_source(cfg, fam)
    res = v.resolution if v.resolution is not None else b.resolution
    rtype = v.resolution_type or b.resolution_type
    type_key = "validate.resolution_type" if v.resolution_type else "buckets.resolution_type"
    problem = _edge_problem(res, rtype, align, src, "validate.resolution", type_key, "validate.resolution_type")
    return [problem] if problem else []


def _text_variants(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    t = cfg.text
    augmenting = [f for f, on in (("text.shuffle_tags", t.shuffle_tags), ("text.tag_dropout", t.tag_dropout > 0)) if on]
    if t.caption_variants == 1 and augmenting:
        # Variants are precomputed (cached, or encoded live from the same list), so one variant means the
        # augmentation could never be seen.
        verb = "need" if len(augmenting) > 1 else "needs"
        return [
            f"{' and '.join(augmenting)} {verb} text.caption_variants > 1 (the number of shuffled/dropped "
            f"variants cached per caption; text.enabled {str(t.enabled).lower()}); set "
            f"text.caption_variants to e.g. 4, or turn {' and '.join(augmenting)} off"
        ]
    if t.caption_variants > 1 and not augmenting:
        return [
            f"text.caption_variants {t.caption_variants} without text.shuffle_tags or text.tag_dropout makes "
            f"{t.caption_variants} identical variants; turn one on or set text.caption_variants to 1"
        ]
    if t.keep_tags and not augmenting:
        return [
            f"text.keep_tags {t.keep_tags} has no effect without text.shuffle_tags or text.tag_dropout; "
            f"set it to 0 or turn one of them on"
        ]
    return []


def _text_length(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    n = cfg.text.max_length
    if n is None or n <= fam.max_length_limit:
        return []
    return [
        f"text.max_length {n} exceeds the {fam.max_length_limit} tokens the text encoder of model.family "
        f"{fam.name} can embed; lower text.max_length or set it to null (the family's default, "
        f"{fam.max_length})"
    ]


def _rendezvous(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    t = cfg.train
    if t.nodes == 1 or not t.rdzv_endpoint:
        return []  # single node runs standalone; a missing endpoint is TrainConfig's own error
    m = ENDPOINT.match(t.rdzv_endpoint)
    if m and 0 < int(m.group(2)) < 65536:
        return []
    return [
        f"train.rdzv_endpoint {t.rdzv_endpoint!r} is not host:port (port 1-65535), which train.nodes "
        f"{t.nodes} needs for the rendezvous every node joins; e.g. node0.cluster:29500"
    ]


HALF = {"float16": "fp16", "bfloat16": "bf16"}


def precision_problem(dtype: str, mixed: str, mode: str, device: str) -> str | None:
    """Why model.dtype x train.mixed_precision cannot train on `device` (cpu | cuda), or None.

    The CPU trains in float32 whatever model.dtype says, without autocast. On CUDA a LoRA's frozen base holds
    model.dtype; half-precision weights meet float32 latents unless autocast computes in their own dtype (without
    it step 1 fails: `mat1 and mat2 must have the same dtype`). A full fine-tune keeps float32 masters, so every
    combination trains. Refused, not converted: computing in a dtype the user did not choose would change what
    `no` promises (float32 math)."""
    if device != "cuda":
        if mixed in HALF.values():
            return (
                f"train.mixed_precision {mixed} needs a CUDA device, and this run trains on the CPU in float32; "
                f"set train.mixed_precision to auto or no, or model.device to cuda/auto"
            )
        return None
    if mode != "lora" or dtype not in HALF:
        return None
    if mixed == "no":
        return (
            f"model.dtype {dtype} with train.mixed_precision no: on CUDA the LoRA's frozen {dtype} base would "
            f"meet float32 inputs at step 1; set train.mixed_precision {HALF[dtype]} (or auto) to compute in "
            f"{dtype} under autocast, or model.dtype float32 to train in float32"
        )
    if mixed in HALF.values() and mixed != HALF[dtype]:
        return (
            f"model.dtype {dtype} with train.mixed_precision {mixed}: autocast would compute in the other "
            f"half-precision type than the frozen base holds; set train.mixed_precision {HALF[dtype]} (or auto)"
        )
    return None


def _training_mode(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    t, problems = cfg.train, []
    # The trainer checks the same with the device it got (model.device auto), but only after scan, latents and
    # text have run; a config that names its device is refused here, at load.
    if cfg.model.device != "auto":
        problem = precision_problem(cfg.model.dtype, t.mixed_precision, t.mode, cfg.model.device)
        if problem:
            problems.append(problem)
    if t.export_single_file and not fam.single_file_export:
        problems.append(
            f"train.export_single_file: model.family {fam.name} has no single-file export (supported: "
            f"{SINGLE_FILE_FAMILIES}); set train.export_single_file false"
        )
    if t.text_encoder_lora and not fam.text_encoder_lora:
        problems.append(
            f"train.text_encoder_lora: model.family {fam.name} has no text-encoder LoRA (supported: "
            f"{TEXT_ENCODER_LORA_FAMILIES}); set train.text_encoder_lora false"
        )
    if t.lora_alpha is not None and t.mode != "lora":
        problems.append(
            f"train.lora_alpha {t.lora_alpha:g} has no effect with train.mode {t.mode}; set "
            f"train.mode lora or train.lora_alpha null"
        )
    return problems


def _prompts(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    v = cfg.validate_
    if not v.prompts:
        return ["validate.prompts is empty: the validate stage would render nothing; give at least one prompt"]
    if not fam.negative_needs_guidance or v.guidance_scale > 1:
        return []
    return [
        f"validate.prompts.{i}.negative_prompt is set but validate.guidance_scale {v.guidance_scale:g} <= 1 "
        f"turns classifier-free guidance off, so model.family {fam.name} ignores the negative prompt; raise "
        f"validate.guidance_scale above 1 or remove the negative prompt"
        for i, p in enumerate(v.prompts)
        if p.negative_prompt
    ]


def _objective(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    """Loss weighting, timestep sampling and prediction type must fit what the family trains on."""
    t, out = cfg.train, []
    if fam.prediction == "flow_matching":
        if t.loss_weighting == "min_snr":
            out.append(
                f"train.loss_weighting min_snr does not fit model.family {fam.name}, which trains by flow "
                f"matching (min-SNR weighting is defined for epsilon/v-prediction); use auto or none"
            )
        if cfg.model.prediction_type != "auto":
            out.append(
                f"model.prediction_type {cfg.model.prediction_type} does not fit model.family {fam.name} "
                f"(flow matching); use auto"
            )
    else:
        if t.timestep_sampling != "uniform":
            out.append(
                f"train.timestep_sampling {t.timestep_sampling} is for flow-matching families "
                f"({FLOW_FAMILIES}); "
                f"model.family {fam.name} samples DDPM timesteps uniformly: use uniform"
            )
        if t.timestep_shift != "auto":
            out.append(
                f"train.timestep_shift {t.timestep_shift} is for flow-matching families "
                f"({FLOW_FAMILIES}); "
                f"model.family {fam.name} has no shift: use auto"
            )
    return out


def _quantize(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    q = cfg.model.quantize
    if q is None:
        return []
    out = []
    if cfg.train.mode != "lora":
        out.append(
            f"model.quantize {q} freezes the base in {q}, which only a LoRA can train on top of: set "
            f"train.mode lora or model.quantize null"
        )
    if cfg.train.adapter != "lora":
        out.append(
            f"train.adapter {cfg.train.adapter} cannot train on a model.quantize {q} base (peft applies only "
            f"a LoRA to quantized layers): set train.adapter lora or model.quantize null"
        )
    if cfg.train.parallelism == "fsdp":
        out.append(
            f"model.quantize {q} with train.parallelism fsdp: FSDP shards plain tensors, not torchao's quantized "
            f"ones; set model.quantize null (FSDP already divides the base by the process count) or "
            f"train.parallelism ddp"
        )
    if q == "fp8" and cfg.model.device == "cpu":
        out.append("model.quantize fp8 needs a CUDA GPU with float8 support; with model.device cpu use int8 or null")
    return out


def _masks(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    if cfg.train.masked_loss and cfg.dataset.masks is None:
        return [
            "train.masked_loss is true but dataset.masks is null: set dataset.masks to alpha or a folder of "
            "mask images, or set train.masked_loss false"
        ]
    return []


def _frames(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    """A video family's frame budgets obey its VAE's rule (Wan: 4k+1 frames)."""
    k = fam.temporal_factor
    bad = [n for n in cfg.buckets.frames or () if k and (n - 1) % k]
    out = []
    if bad:
        out.append(
            f"buckets.frames {cfg.buckets.frames}: {bad} break family {fam.name!r}'s rule of {k}k+1 frames; use "
            f"{[(n - 1) // k * k + 1 for n in bad]} instead, or null for the family's {list(fam.frame_buckets)}"
        )
    n = cfg.validate_.frames
    if n is not None and k and (n - 1) % k:
        out.append(
            f"validate.frames {n} breaks family {fam.name!r}'s rule of {k}k+1 frames; use {(n - 1) // k * k + 1}, "
            "or null for the shortest frame budget"
        )
    return out


def _caption_clips(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    if fam.video and cfg.caption.enabled:
        return [
            f"caption.model is set but model.family {fam.name!r} trains on clips, which the caption stage does not "
            "read: write each clip's caption beside it (clip.txt), or set caption.model null"
        ]
    return []


def _video_demo(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    """The video demo writes clips, which an image family rejects: the scan would accept nothing."""
    if cfg.dataset.demo == "video" and not fam.video:
        return [
            f"dataset.demo video writes clips, and model.family {fam.name!r} trains on images: set model.family to "
            f"a video family ({family_list(lambda f: f.video and not f.variant_of)}), or dataset.demo true for the image demo"
        ]
    return []


def _cpu_dtype(cfg: PipelineConfig, fam: FamilyFacts) -> list[str]:
    if cfg.model.dtype == "float16" and cfg.model.device == "cpu":
        return ["model.dtype float16 is not supported with model.device cpu: use float32 or bfloat16"]
    return []


RULES: tuple[Callable[[PipelineConfig, FamilyFacts], list[str]], ...] = (
    _alignment,
    _caption_clips,
    _bucket_resolution,
    _validate_resolution,
    _text_variants,
    _text_length,
    _rendezvous,
    _training_mode,
    _prompts,
    _objective,
    _masks,
    experts,
    expert_eval,
    _quantize,
    _cpu_dtype,
    _frames,
    _video_demo,
)
