"""Leaner saved activations for a half-precision training step, with the same maths.

What a LoRA step at 1024² kept for its backward, per transformer block, traced with autocast's casts
(tuneline.stages.train.memtrace): every RMSNorm kept a float32 copy of its input (diffusers' RMSNorm upcasts
before squaring; torch's rms_norm and layer_norm run in float32 under CUDA autocast, which casts their input), and
every LoRA layer kept its own 16-bit copy of its input (peft casts the input to the adapter's float32, autocast casts
it back), so the three LoRA projections reading one normalized input held three copies of it. In Z-Image's blocks the
six norms' float32 copies alone were 405 MiB of 1,312 (bench/README.md, gpu.py).

Here the norms of a denoiser keep only their input as it came and a float32 statistic per row, and recompute the
normalized values in the backward (elementwise, exact: the float32 copy is the upcast of the kept input); they
return their input's dtype, so the layers reading them share one saved input. A LoRA layer over a half-precision
base reads its input as it comes: autocast computes the adapter in that dtype anyway, so the values are the same.
"""

from __future__ import annotations

import torch
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

HALF = (torch.float16, torch.bfloat16)


def _rms_scale(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """diffusers' RMSNorm after its statistic: the product in float32, cast to a half-precision weight's dtype
    before the scale (to the input's without a weight)."""
    h = x * rstd
    if weight is None:
        return h.to(x.dtype)
    return (h.to(weight.dtype) if weight.dtype in HALF else h) * weight


class _RMSNorm(torch.autograd.Function):
    """RMSNorm keeping its input and float32 1/rms for the backward (not a float32 copy of the input)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return _rms_scale(x, rstd, weight)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        xhat, g, gw = x.float() * rstd, grad.float(), None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                normed = xhat.to(weight.dtype).float() if weight.dtype in HALF else xhat
                gw = (g * normed).flatten(0, -2).sum(0).to(weight.dtype)
            g = g * weight.float()
        gx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class _LayerNorm(torch.autograd.Function):
    """layer_norm in float32 (as CUDA autocast runs it) keeping the 16-bit input, mean and 1/std; returns the
    input's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        w, b = (None if t is None else t.float() for t in (weight, bias))
        out, mean, rstd = torch.native_layer_norm(x.float(), shape, w, b, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.shape = shape
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        w, b = (None if t is None else t.float() for t in (weight, bias))
        wanted = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        wanted.append(bias is not None and ctx.needs_input_grad[2])
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), ctx.shape, mean, rstd, w, b, wanted
        )
        cast = [None if g is None else g.to(t.dtype) for g, t in ((gx, x), (gw, weight), (gb, bias))]
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


LEAN = {DiffusersRMSNorm: LeanDiffusersRMSNorm, torch.nn.RMSNorm: LeanRMSNorm, torch.nn.LayerNorm: LeanLayerNorm}


def lean_activations(den: torch.nn.Module, half_base: bool) -> None:
    """Makes `den`'s norms the lean ones above (same parameters and state dict: only the class changes), and, over
    a half-precision LoRA base (`half_base`: on CUDA always under autocast, schemas.checks.precision_problem),
    its LoRA layers read their input without peft's cast to float32."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in den.modules():
        lean = LEAN.get(type(m))
        if lean is not None:
            m.__class__ = lean
        elif half_base and isinstance(m, BaseTunerLayer):
            m.cast_input_dtype_enabled = False
