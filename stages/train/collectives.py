"""Every collective the training workers issue, legal on every backend.

NCCL serves CUDA tensors only. The process group therefore gets a CPU backend beside it (`cpu:gloo,cuda:nccl`):
object collectives (the resume agreement) and barriers run there, and everything per step runs on the training
device. Per step the workers issue one all-reduce of their own besides DDP's gradient reduction: the losses of
every micro-batch and the stop/checkpoint flags travel together, one row per rank, so a slow rank costs one
round trip, not two.
"""

from __future__ import annotations

import inspect
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# Test switch: `gloo` serves the CUDA tensors too. NCCL refuses two ranks on one GPU; with gloo two processes can
# share one (bench/gpu.py's two-process figure on a one-GPU machine), and CPU-only tests can build the very group
# a CUDA run builds. Unset (or `nccl`) in production.
CUDA_BACKEND_ENV = "TUNELINE_CUDA_BACKEND"
CUDA_BACKENDS = ("nccl", "gloo")
TIMEOUT = timedelta(minutes=30)


def cuda_backend() -> str:
    name = os.environ.get(CUDA_BACKEND_ENV) or "nccl"
    if name not in CUDA_BACKENDS:
        raise ValueError(
            f"environment variable {CUDA_BACKEND_ENV}={name!r}: use one of {', '.join(CUDA_BACKENDS)} "
            f"(or unset it for nccl)"
        )
    return name


def backend(device: torch.device) -> str:
    """The process group's backend for a run training on `device`: on CUDA a CPU backend beside the CUDA one, so
    CPU collectives (objects, barriers) have a backend that serves them."""
    if device.type == "cuda":
        return f"cpu:gloo,cuda:{cuda_backend()}"
    return "gloo"


def init(device: torch.device) -> None:
    """The process group; on CUDA bound to this rank's GPU (`device_id`: NCCL sets up its communicator there at
    once instead of guessing the device at the first collective). The caller has set the device first."""
    # (The CPU-only tests build a CUDA run's group with no GPU there to bind.)
    cuda = {"device_id": device} if device.type == "cuda" and torch.cuda.is_available() else {}
    dist.init_process_group(backend(device), timeout=TIMEOUT, **cuda)


def active(world: int) -> bool:
    return world > 1 and dist.is_available() and dist.is_initialized()


def shares_gpus() -> bool:
    """Whether ranks may share a GPU: only when gloo serves the CUDA tensors (NCCL refuses it)."""
    return cuda_backend() == "gloo"


def wrap(
    module: torch.nn.Module, params: dict[str, torch.nn.Parameter], device: torch.device, routed: bool = False
) -> DDP:
    """DDP over `module` in which only the trainable parameters take part.

    Every rank loads the same frozen base from the same files, so there is nothing of it to broadcast, and a
    quantized base (torchao's int8/fp8 tensor subclasses) cannot be broadcast at all: DDP's own start-up sync
    fails on it. Of the ways to keep DDP off the base, this one uses only DDP's public arguments: `init_sync=False`
    skips DDP's start-up broadcast of every parameter and buffer, the trainables (which DDP's reducer only ever
    holds: it skips parameters without requires_grad) are broadcast from rank 0 here instead, and buffers (frozen,
    identical on every rank) are not re-broadcast before each forward. Ignoring the frozen parameters by name
    would need DDP's private `_set_params_and_buffers_to_ignore_for_model`; reducing the gradients by hand would
    re-implement DDP's bucketing and its overlap with the backward pass.

    `routed`: a step may not use every trainable parameter (timestep experts), which DDP must look for after each
    forward (find_unused_parameters); those get zero gradients from that rank."""
    broadcast(list(params.values()))
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP).parameters
        else {"broadcast_buffers": False}
    )  # the older name (torch before 2.13)
    # gradient_as_bucket_view: each gradient is a view into DDP's reduction bucket, so the buckets cost no memory
    # beyond the gradients the memory plan counts (without it, another 4 bytes per trainable parameter).
    return DDP(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        init_sync=False,
        gradient_as_bucket_view=True,
        find_unused_parameters=routed,
        **no_buffer_sync,
    )


BROADCAST_BUCKET_BYTES = 256 * 2**20  # a full fine-tune's weights go in pieces: one flat copy at a time


def broadcast(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values of `tensors` on every rank: flattened into buckets of one dtype and at most
    BROADCAST_BUCKET_BYTES (a LoRA's hundreds of small tensors in one or two broadcasts), on the tensors' device."""
    buckets: list[list[torch.Tensor]] = []
    size = 0  # bytes in the last bucket
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or buckets[-1][0].dtype != t.dtype or size + nbytes > BROADCAST_BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    with torch.no_grad():
        for bucket in buckets:
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            dist.broadcast(flat, src=0)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))


def exchange(losses: torch.Tensor, flags: list[float], rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(every rank's losses (world, micro-batches), every rank's flags (world, flags)), both on the CPU and the
    same on every rank, from one all-reduce on the losses' device (the training device).

    Each rank writes its own row of zeros, so the sum is every row side by side; flags are 0.0 or 1.0 and the
    caller checks them with any()."""
    m = len(losses)
    row = torch.cat(
        [
            losses.detach().float().reshape(-1),
            torch.tensor(flags, dtype=torch.float32).to(losses.device, non_blocking=True),
        ]
    )
    if not active(world):
        every = row.unsqueeze(0)
    else:
        every = torch.zeros(world, m + len(flags), device=losses.device)
        every[rank] = row
        dist.all_reduce(every)
    every = every.cpu()
    return every[:, :m], every[:, m:]


def sum_over_ranks(values: torch.Tensor, device: torch.device, world: int) -> torch.Tensor:
    """`values` summed over every rank, on the CPU; the all-reduce runs on the training device (NCCL serves
    CUDA tensors only)."""
    if not active(world):
        return values
    on = values.to(device)
    dist.all_reduce(on)
    return on.cpu()


def everyones(value, world: int) -> list:
    """`value` (picklable) from every rank, in rank order; over the CPU backend."""
    if not active(world):
        return [value]
    every: list = [None] * world
    dist.all_gather_object(every, value)
    return every


def barrier(world: int) -> None:
    if active(world):
        dist.barrier()


def close() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
