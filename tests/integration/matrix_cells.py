"""The training matrix's cells and its per-family launch (tests/integration/test_training_matrix.py asserts on them).

Cells come from the registry and the config schema, so a family or a choice added later joins without editing
the matrix: for every registered family a base cell (train.mode lora, train.adapter lora) and one factor at a time
around it: train.mode full, every other train.adapter choice, train.text_encoder_lora, every model.quantize choice
(another layout of a family, FamilyFacts.variant_of, its base cell only, DDP and FSDP).
The config decides which cells train; a cell it refuses is a refusal cell. The FSDP column: the base cell and
every other factor again with train.parallelism fsdp (cells `<family>-<factor>-fsdp`); the combinations FSDP cannot
shard are its refusal cells. A family that takes control images (the edit families, FLUX.2's references) trains
with them, as its users' edit runs do: one control per target, a folder of two references where the family takes
several.

One torchrun launch (2 gloo processes, tests/matrix_worker.py) trains every cell, with the spec the train stage's
launcher writes and its torchrun command, over caches from the session's upstream store.
"""

from __future__ import annotations

import dataclasses
import json
import typing
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from pydantic import ValidationError

from tuneline.schemas.config import PipelineConfig, parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.model import ModelConfig
from tuneline.schemas.text import TextManifest
from tuneline.schemas.train import TrainConfig
from tuneline.stages.common.stage import run_stage
from tuneline.stages.families import resolve as models
from tuneline.stages.families.registry import family_names, get_family
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.train import launch as train_launch, workers as train_workers
from tuneline.stages.train.timesteps import SigmaSampler

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "matrix_worker.py"
STEPS, ACCUMULATION, PROCESSES = 2, 2, 2
IMAGES = 8  # 2 steps x 2 micro-batches x 2 ranks x batch 1
FSDP_FACTORS = ("lora", "full", "dora", "text_encoder_lora", "int8", "fp8")  # LoRA and full train; the rest are refused
# The matrix trains in PARTS launches of disjoint families, each a group of tests of its own (tests/workers.py), so
# that the parts run on several xdist workers at once instead of one launch outlasting the rest of the suite.
PARTS = 3
# Families placed by hand rather than round robin: each joined the part with the fewest families when it was added.
PLACED = {"wan22": 2, "wan22_ti2v": 1}


@dataclass(frozen=True)
class Cell:
    family: str
    name: str
    section: str  # the config section the factor changes ("" for the base cell)
    change: dict
    fsdp: bool = False  # the FSDP column: train.parallelism fsdp besides the change

    @property
    def id(self) -> str:
        return f"{self.family}-{self.name}" + ("-fsdp" if self.fsdp else "")

    @property
    def field(self) -> str:
        """The changed field as a config message names it, e.g. train.text_encoder_lora."""
        return f"{self.section}.{next(iter(self.change))}" if self.change else ""

    @property
    def part(self) -> int:
        return PLACED.get(self.family, family_names().index(self.family) % PARTS)

    @property
    def ddp_twin(self) -> Cell:
        return dataclasses.replace(self, fsdp=False)


def factors() -> list[tuple[str, str, dict]]:
    """(name, section, change) around the base cell, from the schema's own choices."""
    out: list[tuple[str, str, dict]] = [("lora", "", {})]
    out += [(mode, "train", {"mode": mode}) for mode in typing.get_args(TrainConfig.model_fields["mode"].annotation)]
    out += [(a, "train", {"adapter": a}) for a in typing.get_args(TrainConfig.model_fields["adapter"].annotation)]
    out += [("text_encoder_lora", "train", {"text_encoder_lora": True})]
    quantize = ModelConfig.model_fields["quantize"].annotation
    out += [(q, "model", {"quantize": q}) for arg in typing.get_args(quantize) for q in typing.get_args(arg)]
    base = {"mode": "lora", "adapter": "lora"}
    return [f for f in out if not f[1] or f[2].items() - base.items()]  # the base's own choices are the base cell


def cells() -> list[Cell]:
    """Every factor for each family; another layout of a family (FamilyFacts.variant_of: Wan 2.2's TI2V 5B) its
    base cell, DDP and FSDP, only: the other factors are its family's code paths, which that family's cells train."""
    every = factors()
    column = [(name, section, change) for name, section, change in every if name in FSDP_FACTORS]
    main = [fam for fam in family_names() if not get_family(fam).facts.variant_of]
    variants = [Cell(fam, *every[0], fsdp=f) for fam in family_names() if fam not in main for f in (False, True)]
    return (
        [Cell(fam, *f) for fam in main for f in every]
        + variants
        + [Cell(fam, *f, fsdp=True) for fam in main for f in column]
    )


def dataset(folder: Path) -> None:
    """IMAGES small captioned images (distinct colors), the smallest bucket every family aligns to, in images/;
    controls/ holds one control image per target (its colors reversed), references/ a folder of two per target."""
    rng = np.random.default_rng(0)
    for sub in ("images", "controls", "references"):
        (folder / sub).mkdir(parents=True)
    for i in range(IMAGES):
        pixels = np.clip(rng.normal(40 + 25 * i, 30, (64, 64, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
        (folder / "images" / f"{i}.txt").write_text(f"make it shade {i}", encoding="utf-8")
        Image.fromarray(255 - pixels).save(folder / "controls" / f"{i}.png")
        (folder / "references" / str(i)).mkdir()
        for j in range(2):
            Image.fromarray(np.roll(255 - pixels, 16 * j, axis=1)).save(folder / "references" / str(i) / f"{j}.png")


def config(cell: Cell, data: Path, workdir: Path, seed: int = 0) -> PipelineConfig:
    """The cell's config; raises the config's own refusal (ValidationError or ValueError)."""
    train = {
        "seed": seed,
        "mode": "lora",
        "adapter": "lora",
        "steps": STEPS,
        "grad_accumulation": ACCUMULATION,
        "processes": PROCESSES,
        "batch_size": 1,
        "lora_rank": 4,
        "checkpoint_every": 1,
        "keep_checkpoints": STEPS,
        "lora_format": "both",
        "parallelism": "fsdp" if cell.fsdp else "ddp",
    }
    fam = get_family(cell.family)
    control = None if not fam.takes_control else data / ("references" if fam.multiple_references else "controls")
    data_cfg = {
        "dataset": {"path": str(data / "images"), "control": None if control is None else str(control)},
        "model": {"family": cell.family, "path": None, "device": "cpu"},
        "buckets": {"resolution": 64},
        "train": train,
        "validate": {"learning_check": False},
    }
    if cell.section:
        data_cfg[cell.section] = {**data_cfg[cell.section], **cell.change}
    return parse_config(data_cfg, workdir=str(workdir))


def refusal(cell: Cell, data: Path, workdir: Path) -> str | None:
    """The config's message refusing the cell, or None when it trains."""
    try:
        config(cell, data, workdir)
    except (ValidationError, ValueError) as err:
        return str(err)
    return None


def launch(store, root: Path, wanted: list[Cell]) -> dict[str, Path]:
    """Train the `wanted` cells the config accepts in one torchrun launch (process start-up and imports are paid
    once, not per family); returns cell id -> its output folder, where the worker left each rank's result."""
    data = store.dataset("matrix", dataset)
    plan, outs = [], {}
    for cell in (c for c in wanted if refusal(c, data, root) is None):
        cfg = config(cell, data, root / cell.family)  # one workdir per family: its cells share the caches
        ctx = store.upstream(cfg)
        if get_family(cell.family).facts.experts:
            cfg = config(cell, data, root / cell.family, every_expert_seed(cfg, models.model_dir(ctx), cell.id))
            ctx = store.upstream(cfg)
        out = outs[cell.id] = root / "cells" / cell.id
        plan.append({"name": cell.id, "out": str(out), "spec": _spec(ctx, out / "train"), "replay": cell.ddp_twin.id})
        (out / "cell.json").write_text(json.dumps({"model_dir": plan[-1]["spec"]["model_dir"]}), encoding="utf-8")
    if not plan:
        return outs
    (root / "plan.json").write_text(json.dumps({"cells": plan}), encoding="utf-8")
    cmd = train_workers.worker_command(cfg, root / "plan.json")
    cmd = cmd[: cmd.index("-m", 3)] + [str(WORKER), str(root / "plan.json")]  # our worker in place of the stage's
    try:
        train_workers.run_workers(ctx, cmd, cwd=root)
    except train_launch.TrainingFailed as err:  # each cell's rank files tell which cells it reached
        (root / "launch-error.txt").write_text(str(err), encoding="utf-8")
    return outs


def every_expert_seed(cfg: PipelineConfig, model_dir: Path, cell: str) -> int:
    """The first train.seed whose STEPS steps train every timestep expert of cfg's family: each step trains one,
    drawn from the seed and the step (SigmaSampler.step_share), so a seed of two steps on one expert would leave
    the other untested."""
    fam = get_family(cfg.model.family)
    sampler = SigmaSampler.from_train(cfg.train, splits=(fam.facts.expert_boundary,))
    scheduler = fam.load_noise_scheduler(model_dir).config
    experts = len(fam.facts.experts)
    seeds = range(100)
    found = [s for s in seeds if len({sampler.step_share(s, i, scheduler) for i in range(STEPS)}) == experts]
    assert found, f"cell {cell}: no train.seed in {seeds} trains all {experts} experts in {STEPS} steps"
    return found[0]


def _spec(ctx, work: Path) -> dict:
    """The worker's spec exactly as the train stage's launcher writes it."""
    work.mkdir(parents=True, exist_ok=True)
    upstream = {}
    for name, cls in (("latents", LatentsManifest), ("text", TextManifest)):
        path, _ = run_stage(ctx, stage(name), PIPELINE)  # fresh: the store's copies
        upstream[name] = ctx.store.read(path, cls)
    path = train_launch.write_spec(ctx, work, upstream, None, models.model_dir(ctx), uuid.uuid4().hex)
    spec = json.loads(path.read_text(encoding="utf-8"))
    path.unlink()
    return spec
