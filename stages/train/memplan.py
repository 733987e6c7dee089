"""The memory plan: the peak device memory one training process will need, worked out before any worker starts.

The denoiser is built from its config on the meta device (shapes, no weights, no compute), so a released model's
plan costs seconds on any machine. Terms:

- weights: every parameter at the dtype training holds it in (full: float32 masters; LoRA: model.dtype, int8/fp8
  linears at one byte), the swapped blocks' weights counted only for the R = B - N blocks resident at a time;
- trainable parameters, their gradients and optimizer state (AdamW two float32 moments, adamw8bit two bytes);
  the EMA copy (train.ema);
- activations: a forward of the largest bucket at train.batch_size traced on the meta device, summing the tensors
  autograd saves for backward (saved_tensors_hooks), per transformer block and outside them. With checkpointing
  the blocks keep only their inputs (offload: not even those) plus one block's worth recomputed in backward; under
  16-bit autocast float32 activations count at two bytes;
- on CUDA a fixed reserve for the context and the caching allocator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tuneline.stages.train.swap import max_blocks_to_swap, transformer_blocks

GIB = 1024 ** 3
CUDA_RESERVE = int(0.75 * GIB)  # CUDA context, cuBLAS workspace, allocator rounding
SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Trace:
    """Bytes autograd saves for backward in one forward: outside the blocks, per block, and each block's inputs."""

    outside: int = 0
    blocks: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    float32_share: float = 1.0  # of all saved bytes, the share in float32 (autocast halves it)


@dataclass
class Model:
    """What the plan needs of the denoiser, from its meta build."""

    blocks: list[dict]  # per block: {"frozen": bytes, "trainable": count}
    frozen_outside: int  # bytes of frozen weights outside the blocks
    trainable: int  # trainable parameters (count)
    trainable_in_blocks: list[int]
    trace: dict  # (batch, edge) -> Trace


def build_meta(fam, model_dir: Path, t, dtype: torch.dtype, quantize: str | None):
    """The denoiser on the meta device, with LoRA adapters when training LoRA."""
    cls = fam.pipeline_class._get_signature_types()[fam.denoiser_component][0]
    config = cls.load_config(model_dir, subfolder=fam.denoiser_component)
    with torch.device("meta"):
        den = cls.from_config(config)
    if t.mode == "full":
        den = den.float().requires_grad_(True)
    else:
        from tuneline.stages.train.model import lora_config

        den = den.to(dtype).requires_grad_(False)
        den.add_adapter(lora_config(t, fam.lora_target_modules))
        for p in den.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return den


def weight_bytes(name: str, p: torch.nn.Parameter, linears: set[str], quantize: str | None) -> int:
    if quantize and not p.requires_grad and name.rsplit(".", 1)[0] in linears and p.dim() == 2:
        return p.numel() + 4 * p.shape[0]  # one byte per weight, a float32 scale per row
    return p.numel() * p.element_size()


def describe(den, quantize: str | None) -> tuple[list[dict], int, int, list[int]]:
    linears = {n for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}
    blocks = transformer_blocks(den)
    owner = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            owner[id(p)] = i
    per = [{"frozen": 0, "trainable": 0, "weights": 0} for _ in blocks]
    outside = trainable = 0
    for name, p in den.named_parameters():
        i = owner.get(id(p))
        size = weight_bytes(name, p, linears, quantize)
        if i is None:
            outside += size
        else:
            per[i]["weights"] += size
        if p.requires_grad:
            trainable += p.numel()
            if i is not None:
                per[i]["trainable"] += p.numel()
        elif i is not None:
            per[i]["frozen"] += size
    return per, outside, trainable, [b["trainable"] for b in per]


def text_inputs(fam, den, batch: int) -> dict[str, torch.Tensor]:
    """Conditioning tensors of the shapes the family's text cache holds, from the denoiser's config."""
    c = den.config
    width = c.get("cross_attention_dim") or c.get("joint_attention_dim")
    length = fam.facts.max_length + (77 if c.get("pooled_projection_dim") and "caption_projection_dim" in c else 0)
    out = {"prompt_embeds": torch.zeros(batch, length, width, device="meta")}
    pooled = c.get("pooled_projection_dim")
    if pooled is None and c.get("projection_class_embeddings_input_dim"):
        pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
    if pooled:
        out["pooled_prompt_embeds"] = torch.zeros(batch, pooled, device="meta")
    return out


def trace_activations(fam, den, batch: int, edge: int, dtype: torch.dtype) -> Trace:
    """Bytes saved for backward by one training forward of `batch` images of `edge` x `edge` pixels."""
    from tuneline.stages.families.base import MicroCond

    blocks = transformer_blocks(den)
    params = {p.untyped_storage()._cdata for p in den.parameters()}
    seen: set[int] = set()
    tr = Trace(blocks=[0] * len(blocks), inputs=[0] * len(blocks))
    where = [-1]
    f32 = [0, 0]

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen:
            seen.add(key)
            n = t.untyped_storage().nbytes()
            f32[0] += n if t.dtype == torch.float32 else 0
            f32[1] += n
            if where[0] < 0:
                tr.outside += n
            else:
                tr.blocks[where[0]] += n
        return t

    def enter(i, args, kwargs):
        where[0] = i
        tr.inputs[i] = sum(a.numel() * a.element_size() for a in [*args, *kwargs.values()]
                           if isinstance(a, torch.Tensor))

    hooks = [b.register_forward_pre_hook(lambda m, a, k, i=i: enter(i, a, k), with_kwargs=True)
             for i, b in enumerate(blocks)]
    hooks += [b.register_forward_hook(lambda m, a, o: where.__setitem__(0, -1)) for b in blocks]
    f = fam.facts
    lat = edge // f.vae_factor
    x = torch.zeros(batch, f.latent_channels, lat, lat, device="meta", dtype=dtype)
    ts = torch.zeros(batch, device="meta", dtype=torch.float32 if f.prediction == "flow_matching" else torch.long)
    micro = [MicroCond((edge, edge), (0, 0), (edge, edge))] * batch
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
            fam.denoise(den, x, ts, {k: v.to(dtype) for k, v in text_inputs(fam, den, batch).items()}, micro=micro)
    finally:
        for h in hooks:
            h.remove()
    tr.float32_share = f32[0] / f32[1] if f32[1] else 1.0
    return tr


def largest_edge(buckets, alignment: int) -> int:
    """The edge of a square with the target bucket area (attention and convolutions scale with the area). With
    resolution_type pixel the shorter edge is the resolution, so the square is the planned bucket; a wider one
    (up to buckets.max_aspect) needs more, in proportion to its area."""
    r = buckets.resolution
    if buckets.resolution_type == "area":
        area = r * 1024 * 1024
    elif buckets.resolution_type == "pixel_area":
        area = r * r
    else:
        area = r * r
    return max(alignment, int(math.sqrt(area)) // alignment * alignment)
