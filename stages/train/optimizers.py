"""The optimizer (train.optimizer) and its state in checkpoints.

adamw8bit is torchao's AdamW with block-wise 8-bit moments (a quarter of AdamW's state memory; it runs on CPU too).
Its moments are tensor subclasses safetensors cannot store, so a checkpoint holds their parts (codes, scale,
quantization map) and a resumed run rebuilds the very same state, so it continues exactly.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tuneline.stages.train import checkpoint as ckpt

PARTS = "quantized"
TENSOR_KEYS = "tensor_keys"  # in a param group: the settings the optimizer keeps as tensors  # key in the optimizer's JSON state: flat name -> the subclass's non-tensor attributes


def build_optimizer(params: list[torch.nn.Parameter], t) -> torch.optim.Optimizer:
    if getattr(t, "optimizer", "adamw") == "adamw8bit":
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            raise ValueError("train.optimizer adamw8bit needs torchao: pip install 'tuneline[quantize]'") from None
        return AdamW8bit(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    # foreach: one kernel per op over all tensors; torch picks it only on CUDA by default, and per-tensor
    # updates of a model's hundreds of small tensors cost a CPU as much as a fifth of a step.
    return torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay, foreach=True)


def state_tensors(opt: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Like checkpoint.optimizer_tensors, with quantized state split into plain tensors `<name>/<key>.<part>`."""
    tensors, meta = ckpt.optimizer_tensors(opt, names)
    parts: dict[str, list] = {}
    for flat in [k for k, v in tensors.items() if is_traceable_wrapper_subclass(v)]:
        value = tensors.pop(flat)
        inner, attrs = value.__tensor_flatten__()
        for part in inner:
            tensors[f"{flat}.{part}"] = getattr(value, part)
        parts[flat] = [type(value).__module__, type(value).__qualname__, inner,
                       [str(a) if isinstance(a, torch.dtype) else a for a in attrs]]
    if parts:
        meta[PARTS] = parts
    # torchao keeps the learning rate as a tensor (so a compiled step needs no recompile when it changes)
    for g in meta["param_groups"]:
        tensor_keys = [k for k, v in g.items() if isinstance(v, torch.Tensor)]
        for k in tensor_keys:
            g[k] = g[k].item()
        if tensor_keys:
            g[TENSOR_KEYS] = tensor_keys
    return tensors, meta


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def restore_state(opt: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor], meta: dict) -> None:
    tensors = dict(tensors)
    for flat, (module, qualname, inner, attrs) in meta.get(PARTS, {}).items():
        import importlib

        if not module.startswith("torchao."):  # the JSON names the class; only torchao's state is rebuilt
            raise ckpt.CheckpointError(f"optimizer state {flat} names {module}.{qualname}, not a torchao state")
        cls = getattr(importlib.import_module(module), qualname)
        attrs = [getattr(torch, a.removeprefix("torch.")) if isinstance(a, str) and a.startswith("torch.") else a
                 for a in attrs]
        tensors[flat] = cls.__tensor_unflatten__({p: tensors.pop(f"{flat}.{p}") for p in inner}, attrs, None, None)
    groups = []
    for g in meta["param_groups"]:
        keys = g.get(TENSOR_KEYS, [])
        groups.append({k: (torch.tensor(v) if k in keys else v) for k, v in g.items() if k != TENSOR_KEYS})
    ckpt.restore_optimizer(opt, names, tensors, {**{k: v for k, v in meta.items() if k != PARTS},
                                                 "param_groups": groups})
