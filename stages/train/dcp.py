"""Sharded checkpoints (train.parallelism fsdp): every process writes its own shards, any process count reads them.

    checkpoints/step-0000100/
      shards/shard-0000R-model-00001-of-00001.safetensors   rank R-1's pieces of every tensor, with their offsets in
                                                            the whole tensor in the file's metadata
      state.json                                            written last by rank 0: what checkpoint.py's holds, plus
                                                            "format" and every shard file with its size and sha256

The tensors are `trainable/<param>`, `optimizer/<param>/<key>` and `ema/<param>`, written and read by
torch.distributed.checkpoint through its Hugging Face storage (safetensors: nothing is ever unpickled). Reading
plans which pieces each process needs for the shards it holds now, so a checkpoint of N processes resumes on M,
sharded or not. Atomic like checkpoint.py's: built in a hidden sibling, renamed into place once complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from tuneline.stages.common.artifacts import fsync_file
from tuneline.stages.common.hashing import file_sha256
from tuneline.stages.train import collectives
from tuneline.stages.train.checkpoint import STATE, check_files, checkpoint_name
from tuneline.stages.train.plan import Position

FORMAT = "sharded-safetensors"
SHARDS = "shards"


def is_sharded(path: Path) -> bool:
    try:
        return json.loads((path / STATE).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError):
        return False  # checkpoint.load names what is wrong with it


def save(root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict, rank: int) -> Path:
    """Checkpoint `step` from every process (a collective): each writes its shards, rank 0 the state last."""
    final = root / checkpoint_name(step)
    tmp = root / f".{final.name}.tmp"
    world = state["world_size"]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / SHARDS).mkdir(parents=True)
    collectives.barrier(world)
    import torch.distributed.checkpoint as dist_cp  # only sharded runs write these (see fsdp.py: the import's cost)
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    flat = {f"{group}/{name}": t.detach() for group, named in tensors.items() for name, t in named.items()}
    dist_cp.save(flat, storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True))
    collectives.barrier(world)  # every rank's files are complete
    if rank == 0:
        files = {
            f"{SHARDS}/{f.name}": {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
            for f in sorted((tmp / SHARDS).glob("*.safetensors"))
        }
        global_batch = state["batch_size"] * state["world_size"] * state["grad_accumulation"]
        body = {**state, "step": step, "format": FORMAT, "global_batch": global_batch, "files": files}
        (tmp / STATE).write_text(json.dumps(body), encoding="utf-8")
        for f in [*(tmp / SHARDS).iterdir(), tmp / STATE]:
            fsync_file(f)
        if final.exists():  # a rerun reaching a step an earlier attempt saved: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
    collectives.barrier(world)
    return final


def load(path: Path, trainer) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(state, tensors by group) of a sharded checkpoint, each tensor laid out as `trainer` holds its parameter
    (sharded or whole), after checking every file against state.json."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = json.loads((path / STATE).read_text(encoding="utf-8"))
    check_files(path, state)
    reader = HuggingFaceStorageReader(str(path / SHARDS))
    saved = reader.read_metadata().state_dict_metadata
    targets = {key: _target(key, meta, trainer.params) for key, meta in saved.items()}
    dist_cp.load(targets, storage_reader=HuggingFaceStorageReader(str(path / SHARDS)))
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in targets.items():
        group, name = key.split("/", 1)
        tensors.setdefault(group, {})[name] = value
    return state, tensors


def _target(key: str, meta, params: dict[str, torch.nn.Parameter]) -> torch.Tensor:
    """Where a saved tensor is read to: shaped and sharded like the parameter it belongs to when it has that
    parameter's shape (weights, EMA, Adam's moments), else whole on every rank (a step count)."""
    group, name = key.split("/", 1)
    param = params.get(name.rsplit("/", 1)[0] if group == "optimizer" else name)
    dtype = meta.properties.dtype
    if param is not None and tuple(param.shape) == tuple(meta.size):
        return torch.empty_like(param, dtype=dtype)
    device = param.device if param is not None and param.device.type != "meta" else "cpu"
    return torch.empty(meta.size, dtype=dtype, device=device)


def batch_facts(state: dict, t, world: int) -> dict:
    """What must match for a checkpoint to continue this run. A sharded checkpoint continues on any process count
    at the same global batch (2 processes -> 1 with grad_accumulation doubled); an unsharded one only as made."""
    if state.get("format") == FORMAT:
        return {"global_batch": t.batch_size * world * t.grad_accumulation}
    return {"world_size": world, "batch_size": t.batch_size, "grad_accumulation": t.grad_accumulation}


def position(state: dict, t, world: int) -> Position:
    """Where the data plan continues. On another process count the plan's micro-batches hold another number of
    samples: the run continues the same number of samples into the epoch (the rest of the epoch in the new
    plan's order)."""
    pos = Position(**state["position"])
    before, now = state["batch_size"] * state["world_size"], t.batch_size * world
    return pos if before == now else Position(pos.epoch, pos.index * before // now)
