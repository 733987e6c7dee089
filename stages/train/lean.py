"""Leaner saved activations for a half-precision training step, with the same maths.

What a LoRA step at 1024² kept for its backward, per transformer block, traced with autocast's casts
(tuneline.stages.train.memtrace): every RMSNorm kept a float32 copy of its input (diffusers' RMSNorm upcasts
before squaring; torch's rms_norm and layer_norm run in float32 under CUDA autocast, which casts their input), and
every LoRA layer kept its own 16-bit copy of its input (peft casts the input to the adapter's float32, autocast casts
it back), so the three LoRA projections reading one normalized input held three copies of it. In Z-Image's blocks the
six norms' float32 copies alone were 405 MiB of 1,312 (bench/README.md, gpu.py).

Here the norms of a denoiser keep only their input as it came and a float32 statistic per row, and recompute the
normalized values in the backward (exact: the float32 copy is the upcast of the kept input; on CUDA inside torch's
norm kernels, one call each way); they return their input's dtype, so the layers reading them share one saved
input. A LoRA layer over a half-precision
base reads its input as it comes: autocast computes the adapter in that dtype anyway, so the values are the same.
A SwiGLU gate, silu(gate) * up (Z-Image's feed-forward, FLUX.2's), keeps its two inputs and recomputes silu(gate)
in the backward, where autograd's silu and product also kept silu(gate): a tensor of the feed-forward's inner width
per block (80 MiB in each of Z-Image's 30 main blocks at 1024²), with the same ops each way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU
from diffusers.models.transformers.transformer_z_image import FeedForward as ZImageFeedForward

HALF = (torch.float16, torch.bfloat16)
# torch's fused RMSNorm (aten::_fused_rms_norm and its backward, torch >= 2.9; not in torch's public API, which has no
# RMSNorm returning its statistic, so none whose backward keeps only the input): one kernel each way on CUDA, where
# the elementwise version took a third of a Z-Image LoRA step's GPU time (bench/README.md, rms_norm.py). On the CPU
# the forward is torch's composite of the same float32 ops and the backward has no kernel: _rms_backward stands in.
# Older torch: the elementwise maths throughout.
FUSED = hasattr(torch.ops.aten, "_fused_rms_norm_backward")
# Where the norm kernels take half inputs, compute in float32 and keep float32 statistics (the CPU's layer_norm keeps
# them in the input's dtype). Meta: the memory plan traces there what CUDA runs.
KERNELS = ("cuda", "meta")


def _fused_rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in x's dtype, float32 1/rms per row) from torch's fused kernel. Autocast lists rms_norm in float32,
    not this op: off all the same, so no torch version runs it on a float32 copy of x."""
    with torch.autocast("cuda", enabled=False):
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 1/rms per row: the fused kernel's (one read of x; its normalized output unused), else diffusers'."""
    if FUSED:
        return _fused_rms(x, None, eps)[1]
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def _rms_scale(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """diffusers' RMSNorm after its statistic: the product in float32, cast to a half-precision weight's dtype
    before the scale (to the input's without a weight)."""
    h = x * rstd
    if weight is None:
        return h.to(x.dtype)
    return (h.to(weight.dtype) if weight.dtype in HALF else h) * weight


def _rms_backward(grad, x, rstd, weight, wanted: list[bool], fused: bool):
    """The fused backward's gradients, elementwise in float32 for any mix of dtypes. The weight's is taken from the
    normalized values as the forward scaled them: rounded to a half weight's dtype after _rms_scale, unrounded after
    the fused kernel (so a CPU backward agrees with CUDA's after the same forward)."""
    xhat, g, gx, gw = x * rstd, grad.float(), None, None  # x * rstd: float32 by promotion, no float32 copy of x
    if wanted[1]:
        normed = xhat.to(weight.dtype) if weight.dtype in HALF and not fused else xhat
        gw = (g * normed).flatten(0, -2).sum(0)
    if weight is not None:
        g = g * weight
    if wanted[0]:
        dot = (g * xhat).mean(-1, keepdim=True)
        # the last product writes the input's dtype itself: no separate pass to cast
        gx = torch.mul(torch.addcmul(g, xhat, dot, value=-1), rstd, out=torch.empty_like(x))
    return gx, gw


class _RMSNorm(torch.autograd.Function):
    """RMSNorm keeping its input and float32 1/rms for the backward (not a float32 copy of the input).

    With no weight or one of the input's dtype, torch's fused kernels: the output is the float32 product rounded once
    to the input's dtype (diffusers rounds x/rms to a half weight's dtype before the scale: within that rounding).
    Other mixes (a float32 weight: a float32 output, as diffusers'; fp16 input with a bf16 weight) run elementwise."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.fused = FUSED and (weight is None or weight.dtype == x.dtype)
        if ctx.fused:
            out, rstd = _fused_rms(x, weight, eps)
        else:
            rstd = _rstd(x, eps)
            out = _rms_scale(x, rstd, weight)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        wanted = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        if ctx.fused and x.device.type in KERNELS:
            gx, gw = torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight, wanted)
        else:
            gx, gw = _rms_backward(grad, x, rstd, weight, wanted, ctx.fused)
        return gx, None if gw is None else gw.to(weight.dtype), None


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dtype == torch.float32 else t.float()


class _LayerNorm(torch.autograd.Function):
    """layer_norm in float32 (as CUDA autocast runs it) keeping the 16-bit input, float32 mean and 1/std; returns
    the input's dtype.

    On CUDA with parameters of the input's dtype (or none), torch's kernels on the 16-bit tensors: they compute in
    float32 and keep float32 statistics themselves, so one op each way replaces the casts around a float32 call (the
    backward was host-bound: ~360 µs of CPU per call on an SDXL step)."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        ctx.native = x.device.type in KERNELS and all(t is None or t.dtype == x.dtype for t in (weight, bias))
        if ctx.native:
            with torch.autocast("cuda", enabled=False):  # autocast would run it on a float32 copy of x
                out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        else:
            out, mean, rstd = torch.native_layer_norm(x.float(), shape, _float(weight), _float(bias), eps)
            out = out.to(x.dtype)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.shape = shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        wanted = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        wanted.append(bias is not None and ctx.needs_input_grad[2])
        if ctx.native:
            grads = torch.ops.aten.native_layer_norm_backward(grad, x, ctx.shape, mean, rstd, weight, bias, wanted)
            return (*grads, None, None)
        w = _float(weight)
        # the kernel reads the bias only for its gradient's shape and dtype: the float32 weight has both
        b = None if bias is None else w if w is not None else bias.float()
        grads = torch.ops.aten.native_layer_norm_backward(grad.float(), x.float(), ctx.shape, mean, rstd, w, b, wanted)
        cast = [g if g is None or g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, (x, weight, bias))]
        return (*cast, None, None)


class LeanDiffusersRMSNorm(DiffusersRMSNorm):
    def forward(self, hidden_states):
        if hidden_states.dtype not in HALF or self.bias is not None:
            return super().forward(hidden_states)
        return _RMSNorm.apply(hidden_states, self.weight, self.eps)


class LeanRMSNorm(torch.nn.RMSNorm):
    def forward(self, x):
        if x.dtype not in HALF or len(self.normalized_shape) != 1:
            return super().forward(x)
        # eps None: torch's rms_norm takes the epsilon of the type it computes in (float32 for half input), not
        # the input's (bf16's 0.0078 would swamp the mean square of small activations)
        eps = self.eps if self.eps is not None else torch.finfo(torch.float32).eps
        return _RMSNorm.apply(x, self.weight, eps)


class LeanLayerNorm(torch.nn.LayerNorm):
    def forward(self, x):
        if x.dtype not in HALF:
            return super().forward(x)
        return _LayerNorm.apply(x, self.weight, self.bias, self.normalized_shape, self.eps)


class _SiluGate(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up: the backward recomputes silu(gate) and runs the ops autograd's
    would (the product's gradients, then silu's backward), so the values are the same bit for bit."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return d_gate, (grad * F.silu(gate) if ctx.needs_input_grad[1] else None)


class LeanZImageFeedForward(ZImageFeedForward):
    def _forward_silu_gating(self, x1, x3):
        return _SiluGate.apply(x1, x3)


class LeanFlux2SwiGLU(Flux2SwiGLU):
    def forward(self, x):
        half = x.shape[-1] // 2
        return _SiluGate.apply(x[..., :half], x[..., half:])


LEAN = {
    DiffusersRMSNorm: LeanDiffusersRMSNorm,
    torch.nn.RMSNorm: LeanRMSNorm,
    torch.nn.LayerNorm: LeanLayerNorm,
    ZImageFeedForward: LeanZImageFeedForward,
    Flux2SwiGLU: LeanFlux2SwiGLU,
}


def lean_activations(den: torch.nn.Module, half_base: bool) -> None:
    """Makes `den`'s norms and SwiGLU gates the lean ones above (same parameters and state dict: only the class
    changes), and, over a half-precision LoRA base (`half_base`: on CUDA always under autocast,
    schemas.checks.precision_problem), its LoRA layers read their input without peft's cast to float32."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in den.modules():
        lean = LEAN.get(type(m))
        if lean is not None:
            m.__class__ = lean
        elif half_base and isinstance(m, BaseTunerLayer):
            m.cast_input_dtype_enabled = False
