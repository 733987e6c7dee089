"""The activation term of the memory plan: a training forward traced on the meta device, counting the tensors
autograd saves for backward (saved_tensors_hooks), per transformer block and outside them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tuneline.stages.common.sizing import latent_frames
from tuneline.stages.train.swap import transformer_blocks


@dataclass
class Trace:
    """Bytes autograd saves for backward in one forward: outside the blocks, per block, and each block's inputs."""

    outside: int = 0
    blocks: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)


def text_inputs(fam, den, batch: int) -> dict[str, torch.Tensor]:
    """Conditioning tensors of the shapes the family's text cache holds, from the denoiser's config."""
    c = den.config
    width = c.get("cross_attention_dim") or c.get("joint_attention_dim") or c.get("cap_feat_dim") or c.get("text_dim")
    length = fam.facts.max_length + (77 if c.get("pooled_projection_dim") and "caption_projection_dim" in c else 0)
    out = {"prompt_embeds": torch.zeros(batch, length, width, device="meta")}
    for key in fam.prompt_keys:  # a family whose cache holds a token mask: every token real
        if "mask" in key:
            out[key] = torch.ones(batch, length, dtype=torch.long, device="meta")
    pooled = c.get("pooled_projection_dim")
    if pooled is None and c.get("projection_class_embeddings_input_dim"):
        pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
    if pooled:
        out["pooled_prompt_embeds"] = torch.zeros(batch, pooled, device="meta")
    return out


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel (flash / memory-efficient on CUDA, flash on CPU) keeps for backward: q, k, v,
    the output and a float32 log-sum-exp per query, never the attention matrix. The meta device would otherwise
    take the math path, which saves that matrix. The CUDA kernels write their output token-major (B, L, H, D) and
    return it transposed, so the usual permute back and flatten to (B, L, H*D) for the output projection is a view
    of the output they keep, not a copy."""

    @staticmethod
    def forward(ctx, q, k, v):
        shape = (*q.shape[:-1], v.shape[-1])
        out = q.new_empty((*shape[:-3], shape[-2], shape[-3], shape[-1])).transpose(-2, -3) if q.dim() >= 4 else None
        out = q.new_empty(shape) if out is None else out
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the trace only forwards
        raise NotImplementedError


F = torch.nn.functional
# CUDA autocast's casts (torch.autocast's op lists), as the functions the denoisers call reach them: these compute in
# the autocast dtype, ...
TO_HALF = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose2d, torch.matmul, torch.Tensor.matmul}
TO_HALF |= {torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.baddbmm}
TO_HALF |= {torch.addmm, torch.einsum}
# ... these in float32 (a half input is cast up, and saved so when they keep their input).
TO_FLOAT = {F.layer_norm, F.group_norm, F.rms_norm, F.softmax, F.log_softmax, torch.softmax, torch.Tensor.softmax}
TO_FLOAT |= {torch.pow, torch.Tensor.pow, torch.rsqrt, torch.Tensor.rsqrt, torch.exp, torch.Tensor.exp, F.mse_loss}


class _CudaStep(torch.overrides.TorchFunctionMode):
    """The training step as CUDA runs it, for meta tensors: fused attention (above), and autocast's casts where
    training runs under autocast (autocast never applies to meta tensors). A weight that trains is cast once per
    forward, as autocast caches it; those casts are weights, not activations (`weights`: their storages)."""

    def __init__(self, amp: torch.dtype | None):
        super().__init__()
        self.amp, self.cached, self.weights = amp, {}, set()

    def cast(self, t, dtype: torch.dtype):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
            return [self.cast(x, dtype) for x in t] if isinstance(t, list | tuple) else t
        if not (t.is_leaf and t.requires_grad):
            return t.to(dtype)
        if id(t) not in self.cached:
            self.cached[id(t)] = t.to(dtype)
            self.weights.add(self.cached[id(t)].untyped_storage()._cdata)
        return self.cached[id(t)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = (*args[:3], *(kwargs[n] for n in ("query", "key", "value")[len(args[:3]) :]))
            return _FusedAttention.apply(*(self.cast(t, self.amp) if self.amp else t for t in (q, k, v)))
        dtype = (self.amp if func in TO_HALF else torch.float32 if func in TO_FLOAT else None) if self.amp else None
        if dtype is not None:
            args = tuple(self.cast(a, dtype) for a in args)
            if dtype == self.amp:
                kwargs = {k: self.cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def control_input(fam, batch: int, edge: int, controls: int, dtype: torch.dtype) -> torch.Tensor:
    """Meta control latents as the training loop feeds them: (B, C, h, w), or (B, N, C, h, w) for N references."""
    from tuneline.stages.latents.controls import control_shape

    shape = (batch, *([controls] if controls > 1 else []), *control_shape(fam, edge, edge))
    return torch.zeros(shape, device="meta", dtype=dtype)


def trace_activations(
    fam,
    den,
    batch: int,
    edge: int,
    dtype: torch.dtype,
    controls: int = 0,
    frames: int = 1,
    amp: torch.dtype | None = None,
) -> Trace:
    """Bytes saved for backward by one training forward (under autocast to `amp`, if given: the casts as on CUDA)
    of `batch` images of `edge` x `edge` pixels, each with
    `controls` control images (a paired dataset of an edit family: their tokens join the target's, at the size the
    latents stage caches them); for a video family, clips of `frames` frames, their latent frames stacked along the
    height as the latents stage caches them (every latent frame's tokens attend together)."""

    from tuneline.stages.families.base import MicroCond

    blocks = transformer_blocks(den, fam.block_stacks(den))
    params = {p.untyped_storage()._cdata for p in den.parameters()}
    seen: set[int] = set()
    tr = Trace(blocks=[0] * len(blocks), inputs=[0] * len(blocks))
    where = [-1]

    step = _CudaStep(amp)

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in step.weights and key not in seen:
            seen.add(key)
            n = t.untyped_storage().nbytes()
            if where[0] < 0:
                tr.outside += n
            else:
                tr.blocks[where[0]] += n
        return t

    def enter(i, args, kwargs):
        where[0] = i
        tr.inputs[i] = sum(
            a.numel() * a.element_size() for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)
        )

    hooks = [
        b.register_forward_pre_hook(lambda m, a, k, i=i: enter(i, a, k), with_kwargs=True) for i, b in enumerate(blocks)
    ]
    hooks += [b.register_forward_hook(lambda m, a, o: where.__setitem__(0, -1)) for b in blocks]
    f = fam.facts
    lat = edge // f.vae_factor
    x = torch.zeros(
        batch, f.latent_channels, lat * latent_frames(frames, f.temporal_factor), lat, device="meta", dtype=dtype
    )
    ts = torch.zeros(batch, device="meta", dtype=torch.float32 if f.prediction == "flow_matching" else torch.long)
    micro = [MicroCond((edge, edge), (0, 0), (edge, edge))] * batch
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad(), step:
            inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in text_inputs(fam, den, batch).items()}
            if controls:
                inputs["control_latents"] = control_input(fam, batch, edge, controls, dtype)
            fam.denoise(den, x, ts, inputs, micro=micro)
    finally:
        for h in hooks:
            h.remove()
    return tr
