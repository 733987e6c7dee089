"""The optimizer (train.optimizer) and its state in checkpoints.

Each comes from its maintained package: torch's AdamW, torchao's AdamW8bit, prodigyopt's Prodigy, schedulefree's
AdamWScheduleFree, transformers' Adafactor, lion-pytorch's Lion (`pip install 'tuneline[optimizers]'` for the
third-party ones). Their state is plain tensors and JSON-able numbers, so checkpoints store it as AdamW's.

Schedule-free AdamW trains at one point (y) and evaluates at another (x, the average of its iterates); the
weights it means for use are x. `eval_weights` switches to them for validation and export and puts the exact
training weights back afterwards (a train()/eval() round trip is not bit-exact), so a run that validated
continues as one that did not. Checkpoints hold the training weights and the optimizer's z (its state).

adamw8bit is torchao's AdamW with block-wise 8-bit moments (a quarter of AdamW's state memory; it runs on CPU too).
Its moments are tensor subclasses safetensors cannot store, so a checkpoint holds their parts (codes, scale,
quantization map) and a resumed run rebuilds the very same state, so it continues exactly.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tuneline.stages.train import checkpoint as ckpt

PARTS = "quantized"
TENSOR_KEYS = "tensor_keys"  # in a param group: the settings the optimizer keeps as tensors  # key in the optimizer's JSON state: flat name -> the subclass's non-tensor attributes


# Bytes of optimizer state per trainable parameter (the memory plan's term). Adafactor keeps a row and a column
# second moment per matrix (a few bytes per row/column, counted here as 1 per parameter to stay on the safe side);
# Prodigy keeps AdamW's two moments, its s and the initial weights p0.
STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "prodigy": 16, "adafactor": 1, "adamw_schedulefree": 8, "lion": 4}
# The package each optimizer needs (module, pip extra), for the refusal at load.
PACKAGES = {
    "adamw8bit": ("torchao", "quantize"),
    "prodigy": ("prodigyopt", "optimizers"),
    "adamw_schedulefree": ("schedulefree", "optimizers"),
    "lion": ("lion_pytorch", "optimizers"),
    "adafactor": ("transformers", "optimizers"),
}


def _needs(module: str, name: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = PACKAGES[name][1]
        raise ValueError(
            f"train.optimizer {name} needs the {module} package: pip install 'tuneline[{extra}]'"
        ) from None


def _betas(t, default: tuple[float, float]) -> tuple[float, float]:
    betas = getattr(t, "optimizer_betas", None)
    return tuple(betas) if betas else default


def build_optimizer(params: list[torch.nn.Parameter], t) -> torch.optim.Optimizer:
    name = getattr(t, "optimizer", "adamw")
    if name == "adamw8bit":
        return _needs("torchao.optim", name).AdamW8bit(
            params, lr=t.learning_rate, weight_decay=t.weight_decay, betas=_betas(t, (0.9, 0.999))
        )
    if name == "prodigy":
        return _needs("prodigyopt", name).Prodigy(
            params,
            lr=t.learning_rate,
            weight_decay=t.weight_decay,
            betas=_betas(t, (0.9, 0.999)),
            d_coef=t.prodigy_d_coef,
        )
    if name == "adamw_schedulefree":
        opt = _needs("schedulefree", name).AdamWScheduleFree(
            params, lr=t.learning_rate, weight_decay=t.weight_decay, betas=_betas(t, (0.9, 0.999))
        )
        opt.train()  # it starts in eval mode and refuses to step there
        return opt
    if name == "adafactor":
        # A fixed learning rate (the stage's schedule drives it), as kohya's and SimpleTuner's presets with lr set.
        return _needs("transformers.optimization", name).Adafactor(
            params,
            lr=t.learning_rate,
            weight_decay=t.weight_decay,
            scale_parameter=False,
            relative_step=False,
            warmup_init=False,
        )
    if name == "lion":
        return _needs("lion_pytorch", name).Lion(
            params, lr=t.learning_rate, weight_decay=t.weight_decay, betas=_betas(t, (0.9, 0.99))
        )
    return torch.optim.AdamW(
        params,
        lr=t.learning_rate,
        weight_decay=t.weight_decay,
        betas=_betas(t, (0.9, 0.999)),
        **adamw_kernel(params, t),
    )


# Keys of torch's param groups that choose AdamW's kernel, not its maths: the running process's choice (adamw_kernel)
# also when it resumes a checkpoint written with another.
KERNEL_KEYS = ("foreach", "fused")


def adamw_kernel(params: list, t) -> dict[str, bool]:
    """How torch's AdamW steps `params` (tensors or param groups): fused, the whole update of a parameter in one
    kernel, on whole tensors and FSDP's DTensor shards alike (as torchtitan steps them), on one device.

    foreach runs about ten ops a step over every tensor (a model's hundreds of small ones): on one CPU thread the
    demo UNet's 286 tensors step in 10.0 ms that way and in 2.4 fused; on a GPU it is about ten multi-tensor kernel
    launches against two or three; on shards DTensor works out each op's sharding at a cost that grows with the
    square of the tensor count (the training matrix's SDXL full fine-tune, 2 gloo processes: the first sharded step
    4.1 -> 1.0 CPU-s per process). In float32 fused rounds an ulp apart from foreach; on 16-bit weights it rounds
    once per step where foreach rounds after each op.

    Parameters on two devices step with foreach: there the grad scaler hands the optimizer the sum of the devices'
    overflow flags, and fused AdamW skips a step only when that sum is exactly 1, so an fp16 overflow seen on both
    devices would be applied (torch 2.13). Block swap is taken as two devices even when every trained parameter is
    on one as the optimizer is built: it moves blocks between the CPU and the GPU during a step."""
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    one_device = len({p.device for p in tensors}) <= 1 and not t.blocks_to_swap
    return {"fused": True} if one_device else {"foreach": True}


@contextmanager
def eval_weights(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], restore: bool = True):
    """The weights the optimizer means for use while inside (schedule-free: its averaged x; others: the
    parameters as they are). With `restore`, the exact training weights and mode come back after."""
    if not callable(getattr(opt, "eval", None)):
        yield
        return
    kept = {n: p.detach().clone() for n, p in params.items()} if restore else None
    opt.eval()
    try:
        yield
    finally:
        if restore:
            opt.train()
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(kept[n])


def state_tensors(opt: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Like checkpoint.optimizer_tensors, with quantized state split into plain tensors `<name>/<key>.<part>`."""
    from torch.distributed.tensor import DTensor  # here: importing it costs a second `tuneline plan` needs not

    tensors, meta = ckpt.optimizer_tensors(opt, names)
    parts: dict[str, list] = {}
    # a sharded parameter's state (DTensor) stays whole: the sharded checkpoint (stages/train/dcp.py) reads it back
    for flat in [k for k, v in tensors.items() if is_traceable_wrapper_subclass(v) and not isinstance(v, DTensor)]:
        value = tensors.pop(flat)
        inner, attrs = value.__tensor_flatten__()
        for part in inner:
            tensors[f"{flat}.{part}"] = getattr(value, part)
        parts[flat] = [
            type(value).__module__,
            type(value).__qualname__,
            inner,
            [str(a) if isinstance(a, torch.dtype) else a for a in attrs],
        ]
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
        value = lr * group.get("lr_scale", 1.0)  # a group's own rate as a ratio (train.text_encoder_lr)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def restore_state(opt: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor], meta: dict) -> None:
    tensors = dict(tensors)
    for flat, (module, qualname, inner, attrs) in meta.get(PARTS, {}).items():
        if not module.startswith("torchao."):  # the JSON names the class; only torchao's state is rebuilt
            raise ckpt.CheckpointError(f"optimizer state {flat} names {module}.{qualname}, not a torchao state")
        cls = getattr(importlib.import_module(module), qualname)
        attrs = [
            getattr(torch, a.removeprefix("torch.")) if isinstance(a, str) and a.startswith("torch.") else a
            for a in attrs
        ]
        tensors[flat] = cls.__tensor_unflatten__({p: tensors.pop(f"{flat}.{p}") for p in inner}, attrs, None, None)
    groups = []
    for i, g in enumerate(meta["param_groups"]):
        keys = g.get(TENSOR_KEYS, [])
        live = opt.param_groups[i] if i < len(opt.param_groups) else {}  # a count that differs: torch refuses it
        kernel = {k: live[k] for k in KERNEL_KEYS if k in live}
        groups.append({k: (torch.tensor(v) if k in keys else v) for k, v in g.items() if k != TENSOR_KEYS} | kernel)
    ckpt.restore_optimizer(
        opt, names, tensors, {**{k: v for k, v in meta.items() if k != PARTS}, "param_groups": groups}
    )
