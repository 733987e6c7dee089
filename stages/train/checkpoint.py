"""Training checkpoints: atomic directories of safetensors + JSON, verified on load, the last K kept.

    checkpoints/step-0000100/
      trainable.safetensors   trained parameters by name (the whole denoiser, or its LoRA layers)
      ema.safetensors         their moving average (train.ema)
      optimizer.safetensors   optimizer state tensors as "<param name>/<key>"
      state.json              written last: step, sampler position, schedule, losses, optimizer groups, grad-scaler
                              state, what it was made with (`made_with`: family, mode, adapter, optimizer, dtypes),
                              and every file above with its size and sha256

Nothing is ever unpickled: tensors come from safetensors, everything else from JSON. A checkpoint is built in
a hidden sibling and renamed into place, so a directory named step-N is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tuneline.stages.common.artifacts import fsync_file
from tuneline.stages.common.hashing import file_sha256

CHECKPOINTS = "checkpoints"  # the run folder's checkpoint directory
STATE = "state.json"
NAME = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A resume target is missing, incomplete, corrupt or belongs to a different setup."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def listed(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := NAME.match(p.name)) and (p / STATE).is_file()]
    return sorted(found)


def save(root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict) -> Path:
    """Write checkpoint `step` atomically: each `tensors` entry becomes `<name>.safetensors`, state.json last."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files = {}
    for name, group in tensors.items():
        path = tmp / f"{name}.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in group.items()}, str(path))
        files[path.name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    (tmp / STATE).write_text(json.dumps({**state, "step": step, "files": files}), encoding="utf-8")
    for f in tmp.iterdir():
        fsync_file(f)
    if final.exists():  # a rerun reaching a step an earlier attempt saved: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def prune(root: Path, keep: int) -> None:
    for _, path in listed(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def clear(root: Path) -> int:
    """Remove every checkpoint (and half-written one) under `root`; returns how many complete ones there were."""
    n = len(listed(root))
    if root.is_dir():
        shutil.rmtree(root)
    return n


def load(path: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(state, tensors by file stem) of a checkpoint, after checking every file against state.json."""
    state_file = path / STATE
    if not state_file.is_file():
        raise CheckpointError(
            f"{path} is not a checkpoint (no {STATE}); point train.resume at a checkpoints/step-N "
            f"directory or use latest"
        )
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: {STATE} is not valid JSON ({err})") from None
    check_files(path, state)
    tensors = {name.removesuffix(".safetensors"): load_file(str(path / name)) for name in state.get("files", {})}
    return state, tensors


def check_files(path: Path, state: dict) -> None:
    """CheckpointError unless every file state.json lists is there with its recorded size and checksum."""
    for name, entry in state.get("files", {}).items():
        f = path / name
        if not f.is_file() or f.stat().st_size != entry["bytes"] or file_sha256(f) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} is missing or does not match its recorded size and "
                f"checksum; delete {path} to resume from an earlier checkpoint"
            )


def made_with(cfg) -> dict:
    """What a checkpoint was made with that a resume must match, by config field: another optimizer would load
    foreign state (AdamW's moments into Lion), another adapter, mode or dtype other tensors."""
    t = cfg.train
    return {
        "model.family": cfg.model.family,
        "train.mode": t.mode,
        "train.adapter": t.adapter if t.mode == "lora" else None,
        "train.optimizer": t.optimizer,
        "model.dtype": cfg.model.dtype,
        "train.mixed_precision": t.mixed_precision,
    }


def check_made_with(cfg, path: Path) -> None:
    """Refuse, before any training process starts, a checkpoint made with other settings than the config's
    (naming each, both values and the fix). A checkpoint older than the `made_with` record is refused too: what
    it was made with cannot be confirmed, and a resume is exact or refused."""
    try:
        made = json.loads((path / STATE).read_text(encoding="utf-8")).get("made_with")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"checkpoint {path}: {STATE} cannot be read ({err})") from None
    if not isinstance(made, dict):
        raise CheckpointError(
            f"train.resume: checkpoint {path} does not record the optimizer, adapter and dtypes it was made with "
            f"(it predates that record), so it cannot be confirmed to continue this config exactly: set "
            f"train.resume to null to start from the base model"
        )
    differ = [(k, made.get(k), v) for k, v in made_with(cfg).items() if made.get(k) != v]
    if differ:
        what = "; ".join(f"{k} {was} (the config says {now})" for k, was, now in differ)
        fix = ", ".join(f"{k}: {was}" for k, was, _ in differ if was is not None)
        raise CheckpointError(
            f"train.resume: checkpoint {path} was made with {what}: set {fix} to continue it, or set "
            f"train.resume to null to start from the base model"
        )


def resolve(resume: str | None, root: Path, workdir: Path) -> Path | None:
    """The checkpoint directory train.resume names; a missing target is an error, never a fresh start."""
    if resume is None:
        return None
    if resume == "auto":  # continue an interrupted attempt of this same run if there is one
        found = listed(root)
        return found[-1][1] if found else None
    if resume == "latest":
        found = listed(root)
        if not found:
            raise CheckpointError(
                f"train.resume is latest, but this run has no checkpoint in {root}; set "
                f"train.resume to null to start from the base model, or to a checkpoint directory"
            )
        return found[-1][1]
    path = Path(resume).expanduser()
    path = path if path.is_absolute() else workdir / path
    if not (path / STATE).is_file():
        raise CheckpointError(
            f"train.resume: {path} is not a checkpoint directory (no {STATE}); use latest, a "
            f"checkpoints/step-N directory, or null"
        )
    return path


def optimizer_tensors(opt: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state as named tensors + JSON-able param groups (parameters referred to by name, not index)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, per_param in sd["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{names[idx]}/{key}"] = value
            else:
                scalars[f"{names[idx]}/{key}"] = value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def restore_optimizer(
    opt: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor], meta: dict
) -> None:
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        name, key = flat.rsplit("/", 1)
        if name not in index:
            raise CheckpointError(f"optimizer state names parameter {name!r}, which this model does not train")
        state.setdefault(index[name], {})[key] = value
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})
