"""train.parallelism fsdp: the denoiser sharded over every process with FSDP2 (`fully_shard`).

Each transformer block is one FSDP unit, then the root takes what no block holds (embeddings, norms, a UNet's
convolutions). A unit's parameters are all-gathered just before its forward and freed after it, so a process
holds 1/N of the weights, gradients and optimizer state plus one or two gathered blocks at a time.

`reshard_after_forward` follows torchtitan's pattern: blocks free their gathered weights after the forward (the
backward gathers them again), except the last block, whose backward starts right after its forward and would
gather it again at once; the root's parameters stay gathered through the step for the same reason.

Precision: the shards stay float32 master weights; on CUDA `MixedPrecisionPolicy` gathers them in the autocast
dtype of train.mixed_precision and reduces gradients in float32. CPU trains in float32 throughout, as DDP does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tuneline.schemas.train import TrainConfig
from tuneline.stages.families.common import unwrap
from tuneline.stages.train import fsdpload
from tuneline.stages.train.optimizers import eval_weights
from tuneline.stages.train.swap import transformer_blocks


def wanted(t: TrainConfig) -> bool:
    """Whether this run shards: train.parallelism fsdp inside a process group (torchrun always makes one, also for
    one process, so a checkpoint of N processes resumes in one the same way it resumes in M)."""
    return t.parallelism == "fsdp" and dist.is_available() and dist.is_initialized()


# glibc's malloc tunables, which a process reads when it starts. Every step FSDP allocates and frees each block's
# gathered weights and unsharded gradients, parameter by parameter (up to tens of MB each); glibc serves frees of
# that size from its heap once its mmap threshold has risen (it raises it up to 32 MiB as large blocks are freed),
# and keeps what they leave. Fixed at 128 KiB (its starting value), those tensors get pages of their own, returned
# to the system when freed; as transparent huge pages (hugetlb=1), mapping them afresh each step costs little.
# Measured on bench/fsdp.py's full fine-tune (2 CPU processes): peak 2,230 -> 1,806 MB per process, steps about as
# fast (side by side: 12.7 -> 7.5 s, 9.1 -> 10.2 s); the threshold alone (as where the kernel's transparent huge
# pages are off) made them 1.4-1.6x slower (fresh 4 KiB pages every step).
HOST_MALLOC = ("glibc.malloc.mmap_threshold=131072", "glibc.malloc.hugetlb=1")


def host_memory_env(t: TrainConfig, device: torch.device, env: dict[str, str]) -> dict[str, str]:
    """What to add to `env`, the environment of the training processes, so that the host's memory holds what a
    sharded run keeps (HOST_MALLOC): under train.parallelism fsdp on the CPU, where it was measured. A GPU run
    with train.fsdp_cpu_offload keeps glibc's defaults: where transparent huge pages are off, the threshold alone
    made steps slower, and that trade is unmeasured there. Other C libraries ignore the variable."""
    if t.parallelism != "fsdp" or device.type != "cpu":
        return {}
    return {"GLIBC_TUNABLES": ":".join(filter(None, [env.get("GLIBC_TUNABLES"), *HOST_MALLOC]))}


# torch.distributed.fsdp and .tensor are imported where a run shards, not with this module: their import (DTensor's
# operator tables, sympy) costs each process about 1.5 CPU-s, which a DDP or one-process run never needs. Until
# something imported them, no tensor is a DTensor and no module an FSDP unit (_loaded).


def _loaded(module: str, name: str) -> type | None:
    """The class `name` of `module` once anything imported that module, else None (nothing can be one yet)."""
    mod = sys.modules.get(module)
    return getattr(mod, name) if mod is not None else None


def policy(autocast: torch.dtype | None):
    """Gather parameters in the autocast dtype (none: as stored), reduce gradients in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=autocast, reduce_dtype=torch.float32)


def shard(
    denoiser: torch.nn.Module,
    fam,
    t: TrainConfig,
    device: torch.device,
    autocast: torch.dtype | None,
    model_dir: Path,
) -> dict[str, torch.nn.Parameter]:
    """Shard `denoiser`, a skeleton (tuneline.stages.train.fsdpload) with its adapters, in place over every
    process and load each rank's shard of the weights from `model_dir`; returns its trainable parameters (now
    DTensors) by name.

    fully_shard replaces each parameter by a sharded one, so anything holding the old ones (the optimizer, EMA)
    must be built from the returned dict."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    den = unwrap(denoiser)
    parts = fam.denoiser_parts(den)
    kept = {c: fsdpload.unload(part) for c, part in parts.items()}  # nothing whole is allocated from here on
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kw = {
        "mesh": mesh,
        "mp_policy": policy(autocast),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if t.fsdp_cpu_offload else OffloadPolicy(),
    }
    for part in parts.values():
        blocks = transformer_blocks(part, fam.block_stacks(part))  # the family's declared block stacks
        for i, block in enumerate(blocks):
            fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kw)
        if part is not den:  # a timestep expert: a step runs one (SigmaSampler.step_share), so units of its own
            fully_shard(part, reshard_after_forward=False, **kw)
    fully_shard(den, reshard_after_forward=False, **kw)
    for c, part in parts.items():
        fsdpload.materialize(part, model_dir / c, kept[c], device)
    return {n: p for n, p in den.named_parameters() if p.requires_grad}


def reshard(denoiser: torch.nn.Module) -> None:
    """Free the gathered weights that the root and the last block keep after a forward (reshard_after_forward
    False: a backward frees them). After forwards without a backward (validation renders, evaluation) that ran on
    swapped-in weights (EMA's, schedule-free's average), the next forward must gather the restored shards again,
    not reuse what it gathered then. Nothing to do unsharded."""
    unit = _loaded("torch.distributed.fsdp", "FSDPModule")
    for module in unwrap(denoiser).modules() if unit else ():
        if isinstance(module, unit):
            module.reshard()


def is_sharded(tensor: torch.Tensor) -> bool:
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective for a sharded one: every rank must call it)."""
    value = tensor.full_tensor() if is_sharded(tensor) else tensor
    return value.detach().to("cpu")


def gathered(denoiser: torch.nn.Module, rank: int, fam, assemble) -> torch.nn.Module | None:
    """On rank 0 a plain copy of the sharded `denoiser` with its whole weights on the CPU, for the exports
    (diffusers folders, LoRA and single files are then written exactly as under DDP); None on other ranks.
    `assemble(build)`: the denoiser around `build(component)` per part (Family.build_denoiser).

    A collective: every rank gathers each tensor in turn, rank 0 keeps it. The copy is built on the meta device
    from each part's own config and adapters and takes the gathered tensors as they are, so rank 0 holds one
    CPU copy of the weights, never two."""
    den = unwrap(denoiser)
    weights = {n: full(p) for n, p in den.named_parameters()}
    if rank != 0:
        return None
    names = {id(m): n for n, m in den.named_modules()}
    copies = {}
    for comp, part in fam.denoiser_parts(den).items():
        prefix = f"{names[id(part)]}." if part is not den else ""
        mine = {n.removeprefix(prefix): w for n, w in weights.items() if n.startswith(prefix)}
        copies[comp] = _plain_copy(part, mine)
    return assemble(copies.__getitem__).train(den.training)


def _plain_copy(part: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`part` built on the meta device from its config and adapters, holding `weights` and its own buffers."""
    with torch.device("meta"):
        copy = type(part).from_config(part.config)
    for name, config in getattr(part, "peft_config", {}).items():
        copy.add_adapter(config, adapter_name=name)
    buffers = {n: b.detach().to("cpu") for n, b in part.named_buffers()}  # never sharded: each rank holds them
    persistent = set(copy.state_dict())
    copy.load_state_dict({k: v for k, v in (weights | buffers).items() if k in persistent}, assign=True)
    for name, buf in buffers.items():  # non-persistent buffers are in no state dict
        if name not in persistent:
            owner, _, leaf = name.rpartition(".")
            copy.get_submodule(owner).register_buffer(leaf, buf, persistent=False)
    left = [n for n, p in [*copy.named_parameters(), *copy.named_buffers()] if p.is_meta]
    assert not left, f"the gathered denoiser misses {left[:5]}"
    return copy


def final_denoiser(trainer, rank: int) -> torch.nn.Module | None:
    """The denoiser final/ is written from (on rank 0): the EMA weights when kept, schedule-free AdamW's averaged
    weights, and under FSDP a whole copy gathered from the shards (every rank must call it)."""
    if trainer.ema is not None:
        trainer.ema.copy_to(trainer.params)
    with eval_weights(trainer.opt, trainer.params, restore=False):  # schedule-free: switches to its average
        pass
    if not trainer.sharded:
        return trainer.denoiser
    fam, expert = trainer.fam, trainer.cfg.model.expert
    return gathered(trainer.denoiser, rank, fam, lambda build: fam.build_denoiser(trainer.model_dir, expert, build))
