"""One DDP training process (started by torchrun, or alone when it is the run's only one). Spine: setup -> resume ->
fit -> finish.

Run as `python -m tuneline.stages.train.worker SPEC.json` under torchrun, or alone with torchrun's environment for
rank 0 of 1; the stage's launcher does that (stages/train/workers.py).
Training only reads the caches; it never encodes images or text.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tuneline.schemas.config import parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ImageRecord, ScanManifest
from tuneline.schemas.sources import dataset_sources
from tuneline.schemas.text import TextManifest
from tuneline.stages.caption import captions_by_ref
from tuneline.stages.common.artifacts import ArtifactError, ArtifactStore
from tuneline.stages.common.jsonl import read_jsonl, write_jsonl
from tuneline.stages.families import resolve as models
from tuneline.stages.families.base import latent_affine
from tuneline.stages.families.registry import get_family
from tuneline.stages.latents.reader import LatentReader, ReaderError
from tuneline.stages.latents.store import bucket_key
from tuneline.stages.text import TagAugment
from tuneline.stages.text.live import open_text
from tuneline.stages.text.store import TextCache
from tuneline.stages.train import collectives, evaluation, failcause, fsdp
from tuneline.stages.train.adapters import not_exported
from tuneline.stages.train.checkpoint import CHECKPOINTS, CheckpointError, checkpoint_name
from tuneline.stages.train.export import ExportInfo, resolution_edge
from tuneline.stages.train.failcause import ERROR, LOSS_PNG, LOSSES, RESULT
from tuneline.stages.train.hooks import SAMPLES, Hooks
from tuneline.stages.train.loop import Data, NonFiniteLoss, Trainer
from tuneline.stages.train.model import save_final
from tuneline.stages.train.plan import micro_batches
from tuneline.stages.train.procwatch import worker_guard
from tuneline.stages.train.rows import RowPlan
from tuneline.stages.train.stopping import Interrupted, StopSignals, stop_reason
from tuneline.stages.train.textlora import TrainedText

STOPPED_EXIT = 3
MANIFEST_POINTS = 500


@dataclass
class Run:
    cfg: object
    rank: int
    world: int
    device: torch.device
    family: object
    model_dir: Path
    out: Path
    data: Data
    resume: Path | None
    eval_losses: list[dict] = field(default_factory=list)  # held-out evaluations (train.eval), alike on every rank
    launch: str = ""  # the launching node's token; rank 0 names it in the result, so that node publishes
    seen: str = ""  # where this node's local rank 0 tells its launcher whether rank 0's result reached its folder
    stop_mark: Path | None = None  # exists once the launcher has marked a SIGTERM as a stop (stopping.py)
    export: dict = field(default_factory=dict)  # the launcher's facts for the exported files' metadata
    started_at: float = field(default_factory=time.time)
    step_seconds: float | None = None  # the measured median step after the warm-up (tuneline.stages.train.pace)


def read_data(cfg, up: dict[str, Path], fam, model_dir: Path, device: torch.device) -> Data:
    """What training reads, from the upstream versions `up` (stage -> folder): the worker's one way to open the
    caches, which the in-process trainer of tests and benchmarks (tests/trainer.py) shares."""
    store = ArtifactStore(Path(cfg.workdir))
    # Every rank verifies the manifests it reads; a tampered cache fails on all ranks alike.
    lat = store.read(up["latents"], LatentsManifest)
    txt = store.read(up["text"], TextManifest)
    scan_dir = store.version_dir("scan", lat.upstream["scan"])
    store.read(scan_dir, ScanManifest)
    every = [ImageRecord.model_validate(r) for r in read_jsonl(scan_dir / "images.jsonl")]
    if "caption" in up:  # the caption stage is on: its captions (trigger included) are the ones trained on
        captions = captions_by_ref(up["caption"])
        every = [r.model_copy(update={"caption": captions[r.ref]}) for r in every]
    records = {r.ref: r for r in every}
    # The text cache, or live encoders when the text artifact was built with text.enabled false; with
    # train.text_encoder_lora the encoders being trained (only the artifact's manifest is read).
    if cfg.train.text_encoder_lora:
        augment = TagAugment.from_manifest(txt)
        text = TrainedText(fam, model_dir, device, cfg.train, txt.max_length, augment)
    else:
        text = open_text(txt, up["text"], fam, model_dir, device, models.dtype(cfg, device))
    sized = {(r.ref, bucket_key(r.bucket_width, r.bucket_height, r.frames)): r for r in every}
    reader = LatentReader(up["latents"], lat)
    scaling, shift = latent_affine(lat)  # per channel where the VAE normalises so
    return Data(
        reader=reader,
        text=text,
        records=records,
        scaling=scaling,
        shift=shift,
        sized=sized,
        rows=RowPlan(reader, cfg.train, dataset_sources(cfg)),
    )


def setup(spec: dict) -> Run:
    cfg = parse_config(spec["config"], "<training spec>")
    cuda = torch.cuda.is_available() and cfg.model.device != "cpu"
    # Ranks share a GPU only under the gloo test switch (tuneline.stages.train.collectives); the launcher refuses
    # more processes than GPUs otherwise.
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)  # before the process group, which binds to it (collectives.init)
    collectives.init(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    fam, model_dir = get_family(cfg.model.family), Path(spec["model_dir"])
    up = {k: Path(v) for k, v in spec["upstream"].items()}
    data = read_data(cfg, up, fam, model_dir, device)
    return Run(
        cfg=cfg,
        rank=rank,
        world=world,
        device=device,
        family=fam,
        model_dir=model_dir,
        out=Path(spec["out_dir"]),
        data=data,
        resume=Path(spec["resume"]) if spec.get("resume") else None,
        launch=spec.get("launch", ""),
        seen=spec.get("seen", ""),
        stop_mark=Path(spec["stop"]) if spec.get("stop") else None,
        export=spec.get("export", {}),
    )


def agree_on_resume(run: Run) -> None:
    """Every rank (every node's launcher resolved train.resume on its own) must continue the same checkpoint."""
    every = collectives.everyones(run.resume.name if run.resume else None, run.world)
    if len(set(every)) > 1:
        found = ", ".join(f"rank {r}: {v or 'none'}" for r, v in enumerate(every))
        raise ValueError(
            f"the nodes would resume from different checkpoints ({found}): nodes must share the "
            f"workdir (the train stage's checkpoints), or set train.resume to the same checkpoint "
            f"on every node"
        )


def fit(run: Run) -> Trainer:
    t = run.cfg.train
    agree_on_resume(run)
    trainer = Trainer(run.cfg, run.family, run.model_dir, run.data, run.rank, run.world, run.device, run.resume)
    if run.resume is not None and run.rank == 0:
        print(f"resumed from {run.resume} at step {trainer.step}", flush=True)
    hooks = Hooks(run, trainer)
    rows = run.data.rows
    held = rows.held_rows()
    evaluator = evaluation.Evaluator(trainer, held, t.eval.timesteps, t.batch_size) if held else None
    feed = trainer.feed(micro_batches(rows.epoch_plans(run.world), t.batch_size, run.rank, trainer.position))
    with closing(feed):  # the feed's thread stops with the loop, however it ends
        signals = StopSignals(t.checkpoint_minutes, run.stop_mark)
        while trainer.step < t.steps:
            hooks.before_step()
            micro = [next(feed) for _ in range(t.grad_accumulation)]
            trainer.train_step(micro, signals.flags())  # the flags ride the step's loss all-reduce
            hooks.after_step()
            if evaluator and (trainer.step % t.effective_eval_every() == 0 or trainer.step == t.steps):
                run.eval_losses.append(evaluator.evaluate())  # every rank its share (evaluation.py)
                if run.rank == 0:
                    print(f"step {trainer.step}/{t.steps} eval loss {run.eval_losses[-1]['loss']:.4f}", flush=True)
            stop, save = signals.decide(trainer.flags)
            if save and hooks.last_checkpoint != trainer.step:
                hooks.checkpoint()
            if hooks.last_checkpoint == trainer.step:
                signals.checkpointed()
            if stop:
                collectives.barrier(run.world)  # every rank leaves once rank 0's checkpoint is written
                raise Interrupted(stop_reason(trainer.step, t.steps, checkpoint_name(trainer.step)))
    per = hooks.meter.step_seconds()
    run.step_seconds = None if per is None else round(per, 4)  # a wall time on a shared machine: 4 digits say it
    return trainer


def finish(run: Run, trainer: Trainer) -> None:
    """Rank 0 writes final/ (the EMA weights when kept), the loss table, and the result the launcher turns into the
    manifest (and draws the loss table into loss.png); the others wait so nobody exits before it exists."""
    t = run.cfg.train
    final = fsdp.final_denoiser(trainer, run.rank)  # a collective under FSDP: the whole weights, on rank 0
    if run.rank == 0:
        exports = save_final(run.family, run.model_dir, final, t, run.out / "final", export_info(run), trainer.text)
        write_jsonl(run.out / LOSSES, ({"step": i + 1, "loss": v} for i, v in enumerate(trainer.losses)))
        kept = sorted(p.name for p in (run.out / CHECKPOINTS).iterdir() if not p.name.startswith("."))
        samples = sorted(p.name for p in (run.out / SAMPLES).glob("*.png")) if (run.out / SAMPLES).is_dir() else []
        result = {
            "launch": run.launch,
            "family": run.family.facts.name,
            "mode": t.mode,
            "step": trainer.step,
            "world_size": run.world,
            "global_batch": t.global_batch(run.world, per_step=True),
            "ema": t.ema,
            "checkpoint": f"{CHECKPOINTS}/{kept[-1]}",
            "checkpoints": [f"{CHECKPOINTS}/{k}" for k in kept],
            "samples": [f"{SAMPLES}/{s}" for s in samples],
            "loss_curve": LOSS_PNG,
            "resumed_from": str(run.resume) if run.resume else None,
            "losses": downsample(trainer.losses, MANIFEST_POINTS),
            "eval_losses": run.eval_losses,
            "seen_per_source": run.data.rows.seen_per_source(
                trainer.step * t.grad_accumulation, run.world, dataset_sources(run.cfg)
            ),
            "exports": exports,
            "adapter": t.adapter if t.mode == "lora" else None,
            "not_exported": not_exported(t),
            "text_encoder_lora": trainer.text is not None,
            "text_cache_read": isinstance(run.data.text, TextCache),
            # measured beside the memory plan (tuneline.stages.train.memplan)
            "peak_memory": torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None,
            "step_seconds": run.step_seconds,
        }
        (run.out / RESULT).write_text(json.dumps(result), encoding="utf-8")
    collectives.barrier(run.world)
    # Whether the nodes share a workdir shows in whether rank 0's result is in this node's work folder; each node
    # looks before any can leave (the publishing node's launcher consumes the result once its workers exit).
    if run.seen and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(run.seen).write_text(json.dumps({"result_here": (run.out / RESULT).is_file()}), encoding="utf-8")
    collectives.barrier(run.world)


def export_info(run: Run) -> ExportInfo:
    """The run's facts for the exported files' headers: training images (held-out ones excluded), resolution,
    and caption tag counts only when train.metadata_captions allows captions to leave the run."""
    cfg, t = run.cfg, run.cfg.train
    images = len(run.data.rows.trained_refs())
    tags: Counter = Counter()
    if t.metadata_captions:
        for rec in run.data.records.values():
            tags.update(tag.strip() for tag in rec.caption.split(",") if tag.strip())
    return ExportInfo(
        train_version=run.export.get("train_version", run.out.name),
        base_identity=run.export.get("base_identity", ""),
        steps=t.steps,
        num_train_images=images,
        resolution=resolution_edge(cfg.buckets.resolution, cfg.buckets.resolution_type),
        started_at=run.started_at,
        title=f"tuneline {run.family.facts.name} {'LoRA' if t.mode == 'lora' else 'fine-tune'}",
        tag_frequency=dict(tags),
    )


def downsample(values: list[float], points: int) -> list[float]:
    """At most `points` values, each the mean of a run of consecutive steps."""
    if len(values) <= points:
        return [round(v, 6) for v in values]
    per = -(-len(values) // points)
    return [round(sum(values[i : i + per]) / len(values[i : i + per]), 6) for i in range(0, len(values), per)]


def main(argv: list[str]) -> None:
    worker_guard()
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    rank, out = int(os.environ.get("RANK", "0")), Path(spec["out_dir"])
    try:
        run = setup(spec)
        finish(run, fit(run))
    except Interrupted as err:
        if rank == 0:  # the launcher reads it: the stop's step and checkpoint
            (out / ERROR).write_text(json.dumps({"error": str(err), "stopped": True}), encoding="utf-8")
            print(f"training {err}", file=sys.stderr, flush=True)
        sys.exit(STOPPED_EXIT)
    except (NonFiniteLoss, CheckpointError, ArtifactError, ReaderError, ValueError) as err:
        # A verdict the user acts on (every rank usually reaches it alike: losses are all-gathered, manifests and
        # checkpoints read alike): its message, without a traceback.
        failcause.record(out, rank, err, str(err))
        print(f"training stopped: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as err:
        failcause.record(out, rank, err)  # the launcher names the rank that failed first (failcause.py)
        raise
    finally:
        collectives.close()
        gc.freeze()  # the exit's last garbage collection would walk every object torch and diffusers made


if __name__ == "__main__":
    main(sys.argv[1:])
