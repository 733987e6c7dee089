"""Loading a sharded denoiser (train.parallelism fsdp) without any rank holding the whole of it.

1. `skeleton`: the denoiser built from its config with no weights. Each parameter is a stub: a view of one zero
   element at every index (`expand`), on the CPU with the right shape and the dtype from_pretrained would give it
   (the modules a model class keeps in float32 stay float32). Buffers are real (some are computed when the model
   is built). peft adds its adapters to the skeleton exactly as to the loaded model: the
   same modules, the same random draws from the same seed, so the adapters start as DDP's do.
2. `unload` (before `fully_shard`): the stubs become meta parameters, so sharding allocates nothing for them; the
   adapters' starting values are kept whole (they are small) with the buffers.
3. `materialize` (after `fully_shard`): every rank allocates only its own shard of each parameter (`to_empty`) and
   fills it: a stub's rows read from the model folder's safetensors files (a slice read: the rest of the tensor
   is never read), an adapter's rows from its kept value. FSDP2 shards dim 0 as `torch.chunk` does.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

WEIGHTS = "diffusion_pytorch_model.safetensors"
# One zero per dtype, viewed by every stub: a stub is known by sharing its storage.
_ZEROS: dict[torch.dtype, torch.Tensor] = {}


def _zero(dtype: torch.dtype) -> torch.Tensor:
    return _ZEROS.setdefault(dtype, torch.zeros((), dtype=dtype))


def is_stub(p: torch.Tensor) -> bool:
    return (
        not p.is_meta
        and p.dtype in _ZEROS
        and p.untyped_storage().data_ptr() == _ZEROS[p.dtype].untyped_storage().data_ptr()
    )


def skeleton(fam, expert: str | None = None):
    """A loader with fam.load_denoiser's signature that builds the skeleton (the device is FSDP's to apply): of
    each denoiser component model.expert `expert` holds (Family.build_denoiser)."""

    def load(model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return fam.build_denoiser(model_dir, expert, lambda comp: _skeleton(fam.denoiser_class, model_dir, comp, dtype))

    return load


def _skeleton(cls, model_dir: Path, component: str, dtype: torch.dtype) -> torch.nn.Module:
    from accelerate import init_empty_weights  # here, not at import: the launcher imports this module

    check_weights(model_dir / component, cls.__name__)
    with init_empty_weights():  # parameters on the meta device, buffers real
        den = cls.from_config(cls.load_config(model_dir, subfolder=component))
    fp32 = fp32_modules(cls)
    for owner, module in den.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            keep = fp32 & set(f"{owner}.{name}".split("."))
            stub = _zero(torch.float32 if keep else dtype).expand(p.shape)
            module.register_parameter(name, torch.nn.Parameter(stub, requires_grad=p.requires_grad))
    return den


def fp32_modules(cls) -> set[str]:
    """The module names whose parameters `cls.from_pretrained(dtype=...)` loads in float32 whatever the dtype
    (Wan's time embedder, norms and modulation tables): diffusers' loader keeps a floating parameter float32 when
    one of the dot-separated parts of its name is listed in the class's `_keep_in_fp32_modules`. diffusers offers
    no public accessor for that list; tests/integration/test_fsdp_load.py compares every dtype with from_pretrained's,
    so a change in diffusers' rule shows there."""
    return set(getattr(cls, "_keep_in_fp32_modules", None) or ())


def unload(den: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Turn the stubs into meta parameters; returns what materialize needs: the other parameters' values (the
    adapters') and every buffer, whole."""
    kept = {n: p.detach().clone() for n, p in den.named_parameters() if not is_stub(p)}
    for module in den.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if is_stub(p):
                meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                module.register_parameter(name, torch.nn.Parameter(meta, requires_grad=p.requires_grad))
    return {"params": kept, "buffers": {n: b.detach().clone() for n, b in den.named_buffers()}}


def materialize(den: torch.nn.Module, folder: Path, kept: dict, device: torch.device) -> None:
    """Allocate this rank's shards on `device` and fill them (stubs from `folder`'s safetensors files)."""
    from torch.distributed.tensor import DTensor  # imported by sharding, which precedes this (fsdp.py)

    den.to_empty(device=device)
    paths = _weight_files(folder)
    persistent = set(den.state_dict())
    with ExitStack() as stack, torch.no_grad():
        opened = {f: stack.enter_context(safe_open(f, "pt")) for f in set(paths.values())}
        files = {k: opened[f] for k, f in paths.items()}
        for name, b in kept["buffers"].items():
            mine = den.get_buffer(name)
            key = name if name in persistent and name in files else None
            mine.copy_(_read(files, key, slice(None)) if key else b)
        for name, p in den.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            rows = _rows(p, local)
            if name in kept["params"]:
                local.copy_(kept["params"][name][rows])
                continue
            key = name.replace(".base_layer.", ".")  # peft wraps the targeted layers
            if key not in files:
                raise ValueError(f"{folder}: the weights hold no tensor {key}; rebuild the model folder")
            local.copy_(_read(files, key, rows))


def _rows(p: torch.Tensor, local: torch.Tensor) -> slice:
    """The rows of the whole parameter this rank holds: torch.chunk's split of dim 0 over the mesh."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor) or p.dim() == 0:
        return slice(None)
    n, world, rank = p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank()
    size = -(-n // world)
    start = min(rank * size, n)
    stop = min(start + size, n)
    assert local.shape[0] == stop - start, (p.shape, local.shape, rank)
    return slice(start, stop)


def check_weights(folder: Path, cls_name: str) -> None:
    """ValueError naming `folder` (a denoiser's, holding a `cls_name`) and the fix unless its weights are
    safetensors, which each process can read its rows of. File names only: the launcher asks before any process
    starts (stages/train/launch.py), the skeleton again for callers without a launcher."""
    if (folder / f"{WEIGHTS}.index.json").is_file() or (folder / WEIGHTS).is_file():
        return
    held = (
        sorted(f.name for f in folder.iterdir() if f.is_file() and f.name != "config.json") if folder.is_dir() else []
    )
    raise ValueError(
        f"train.parallelism fsdp: {folder} has no {WEIGHTS} (or its index), only {', '.join(held) or 'no files'}: "
        f"each process reads its own rows of the weights from safetensors files. Save them as safetensors in "
        f"that folder: python -c \"from diffusers import {cls_name} as M; M.from_pretrained('{folder}')"
        f".save_pretrained('{folder}')\" (or set train.parallelism: ddp)"
    )


def check_components(fam, model_dir: Path, expert: str | None) -> None:
    """check_weights of every denoiser component model.expert `expert` holds (Family.build_denoiser), for the
    launcher to ask before any process starts."""

    def check(component: str) -> torch.nn.Module:
        check_weights(model_dir / component, fam.denoiser_class.__name__)
        return torch.nn.Module()  # a stand-in: only the components are asked for

    fam.build_denoiser(model_dir, expert, check)


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (a sharded folder's index, or the one file: check_weights
    has made sure of one)."""
    index = folder / f"{WEIGHTS}.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    with safe_open(folder / WEIGHTS, "pt") as f:
        return dict.fromkeys(f.keys(), folder / WEIGHTS)


def _read(files: dict, key: str, rows: slice) -> torch.Tensor:
    """`rows` of tensor `key` (its files opened once: safe_open maps them and reads only what is sliced)."""
    part = files[key].get_slice(key)
    return part[rows] if part.get_shape() else files[key].get_tensor(key)
