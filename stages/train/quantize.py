"""Quantized frozen base for LoRA training (torchao): the base's linear weights in int8 or fp8, LoRA on top.

torchao rather than optimum-quanto: it is PyTorch's own quantization library, PEFT's LoRA layers wrap its
quantized linears directly, and its int8 weight-only path runs forward and backward on CPU. Only `nn.Linear`
is quantized: embeddings, norms and convolutions have no int8/fp8 kernels (an fp8 embedding fails in
index_select), so they stay in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def check_supported(quantize: str, device: torch.device) -> None:
    """fp8 needs a CUDA device with float8 matmul (compute capability 8.9+); refuse anywhere else."""
    if quantize != "fp8":
        return
    ok = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    if not ok:
        raise ValueError(
            f"model.quantize fp8 needs a CUDA GPU with float8 support (compute capability 8.9+, e.g. "
            f"L4/H100); this run is on {device.type}: set model.quantize to int8 or null"
        )


def quantize_base(module: torch.nn.Module, quantize: str, device: torch.device) -> torch.nn.Module:
    """The frozen module, from the host, on `device`: each linear layer quantized in place as it reaches the device
    (one full-precision linear there at a time), then the rest moved. Quantized on the device whole, the 16-bit base
    was the run's peak (FLUX.2 [klein] 4 B over int8 on an H200: 7.63 GiB, where its checkpointed training plans
    5.99)."""
    check_supported(quantize, device)
    try:
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ValueError(f"model.quantize {quantize} needs torchao: pip install 'tuneline[quantize]'") from None

    config = Int8WeightOnlyConfig() if quantize == "int8" else Float8WeightOnlyConfig()
    for layer in [m for m in module.modules() if isinstance(m, torch.nn.Linear)]:
        quantize_(layer.to(device), config, filter_fn=_linear)
        if type(layer) is torch.nn.Linear and is_traceable_wrapper_subclass(layer.weight):  # quantize_ leaves some
            layer.__class__ = FrozenQuantizedLinear  # plain (e.g. odd shapes)
    return module.to(device)


def _linear(module: torch.nn.Module, _fqn: str) -> bool:
    return isinstance(module, torch.nn.Linear)  # every linear: torchao's default filter skips some subclasses


class _LinearOverQuantized(torch.autograd.Function):
    """x W^T + b over a frozen quantized W whose backward dequantizes W again. Autograd's own linear over
    torchao's weight saves the dequantized copy of W for the input's gradient: every quantized layer then held a
    full-precision weight until the backward, more than the bf16 base itself (FLUX.2 [klein] 4B LoRA at 1024² on
    an H200: 35.0 GiB peak over an int8 base, 23.4 GiB over the bf16 one)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        # An attribute, not save_for_backward: saved-tensor hooks (offloaded activations) would copy the weight.
        ctx.weight = weight
        out = F.linear(x, weight, bias)
        ctx.dtype = out.dtype  # the backward's matmul in the forward's (autocast's) dtype, as autograd's linear
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype) @ ctx.weight.dequantize().to(ctx.dtype), None, None


class FrozenQuantizedLinear(torch.nn.Linear):
    """A quantized base linear (frozen: LoRA trains beside it) that keeps no full-precision weight for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchao's weight takes F.linear before autocast sees it, and computes in the input's dtype: cast as autocast
        # casts a linear's input, or a float32 activation (a norm's output) makes every later layer float32 too
        # (FLUX.2 [klein] 4B LoRA at 1024² on an H100: 1.01 s/step and 28.3 GiB over int8, 0.34 s and 22.0 over bf16).
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if not torch.is_grad_enabled() or not x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return _LinearOverQuantized.apply(x, self.weight, self.bias)
