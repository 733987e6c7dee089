"""Reading a weights file with its fp8 tensors upcast: the files ComfyUI distributes are often `float8_e4m3fn`,
plain or "scaled", and no stage computes in float8 (schemas/model.py), so they are dequantized once at load.

The scaled layouts are the two that ComfyUI reads (`comfy/utils.py: convert_old_quants`, `comfy/ops.py`):
- old: a `scaled_fp8` marker tensor (after the model's key prefix) and, per quantized linear `X`, `X.scale_weight`
  (and `X.scale_input`, an activation scale that only matters to fp8 matmuls);
- current: `X.weight_scale` (and `X.input_scale`), with the per-layer format in `X.comfy_quant` tensors or the
  file's `_quantization_metadata` header entry.
The weight is `X.weight.float() * scale` (a per-tensor scalar, or one scale per output row).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALES = (".scale_weight", ".weight_scale")
DROPPED = (".scale_input", ".input_scale", ".comfy_quant")
PER_TENSOR_FORMATS = ("float8_e4m3fn", "float8_e5m2")


def read_weights(file: Path, field: str) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors `file`, fp8 ones dequantized to float32 (errors name `field`)."""
    from safetensors import safe_open

    if Path(file).suffix.lower() != ".safetensors":
        raise ValueError(f"{field}: {file} is not a .safetensors file; give the .safetensors file of that part")
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # a truncated or foreign file: name it
        raise ValueError(f"{field}: cannot read {file} as safetensors ({type(exc).__name__}: {exc})") from exc
    return upcast(sd, meta, f"{field}: {file}")


def _formats(sd: dict[str, torch.Tensor], meta: dict[str, str]) -> dict[str, str]:
    """Quantized layer -> its format, from the header entry or the `.comfy_quant` tensors."""
    layers = json.loads(meta["_quantization_metadata"]).get("layers", {}) if "_quantization_metadata" in meta else {}
    for k, v in sd.items():
        if k.endswith(".comfy_quant"):
            layers[k.removesuffix(".comfy_quant")] = json.loads(bytes(v.tolist()).decode("utf-8"))
    return {k: str(v.get("format", "")) for k, v in layers.items()}


def upcast(sd: dict[str, torch.Tensor], meta: dict[str, str], where: str) -> dict[str, torch.Tensor]:
    """`sd` with scales applied and fp8 tensors as float32; other tensors are returned unchanged."""
    odd = {k: f for k, f in _formats(sd, meta).items() if f not in PER_TENSOR_FORMATS}
    if odd:
        layer, fmt = next(iter(odd.items()))
        raise ValueError(
            f"{where}: {len(odd)} layer(s) are quantized as {fmt!r} (e.g. {layer}), which cannot be dequantized "
            f"here (only {' and '.join(PER_TENSOR_FORMATS)} with per-tensor or per-row scales); use the file's "
            f"bf16/fp16 or fp8 release"
        )
    scales = {k.rsplit(".", 1)[0]: v for k, v in sd.items() if k.endswith(SCALES)}
    out = {k: v for k, v in sd.items() if not k.endswith(SCALES + DROPPED + ("scaled_fp8",))}
    scaled = {f"{layer}.weight" for layer in scales}
    for layer, scale in scales.items():
        name = f"{layer}.weight"
        if name not in out:
            raise ValueError(f"{where}: {layer} has a weight scale but no {name}; the file is incomplete")
        w, s = out[name].float(), scale.float()
        if s.numel() == 1:
            s = s.reshape(())
        elif s.numel() == w.shape[0]:
            s = s.reshape(-1, *([1] * (w.dim() - 1)))
        else:
            raise ValueError(
                f"{where}: {layer}'s weight scale has {s.numel()} values for a weight of shape {list(w.shape)} "
                f"(expected one, or one per output row)"
            )
        out[name] = w * s
    # Dequantized weights take the dtype the file keeps its other floats in (bf16 in ComfyUI's fp8 files: a bf16
    # mantissa holds every fp8 value times its scale closely), float32 where it has none.
    kept = [v.dtype for k, v in out.items() if v.is_floating_point() and v.dtype not in FP8 and k not in scaled]
    dtype = max(set(kept), key=kept.count) if kept else torch.float32
    return {k: v.to(dtype) if v.dtype in FP8 or k in scaled else v for k, v in out.items()}
