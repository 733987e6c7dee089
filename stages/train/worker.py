"""One DDP training process (started by torchrun). Spine: setup -> fit -> save.

Run as `python -m stages.train.worker SPEC.json` under torchrun; the stage's launcher does that.
Training only reads the caches; it never encodes images or text.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

from schemas.config import parse_config
from schemas.latents import LatentsManifest
from schemas.scan import ImageRecord, ScanManifest
from schemas.text import TextManifest
from stages.common.artifacts import ArtifactStore
from stages.common.jsonl import read_jsonl, write_jsonl
from stages.families.base import MicroCond
from stages.families.registry import get_family
from stages.latents.reader import LatentReader, epoch_plan
from stages.text.store import TextCache
from stages.train.objective import noisy_and_target, scale_latents
from stages.train.procwatch import worker_guard


@dataclass
class Run:
    cfg: object
    rank: int
    world: int
    device: torch.device
    family: object
    model_dir: Path
    out: Path
    reader: LatentReader
    text: TextCache
    records: dict[str, ImageRecord]
    scaling: float
    shift: float


def micro_cond(rec: ImageRecord) -> MicroCond:
    left, top, right, _ = rec.crop
    scale = rec.bucket_width / max(1, right - left)
    return MicroCond(original_size=(rec.height, rec.width), crop_top_left=(round(top * scale), round(left * scale)),
                     target_size=(rec.bucket_height, rec.bucket_width))


def setup(spec: dict) -> Run:
    cfg = parse_config(spec["config"], "<training spec>")
    cuda = torch.cuda.is_available() and cfg.model.device != "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = ArtifactStore(Path(cfg.workdir))
    up = {k: Path(v) for k, v in spec["upstream"].items()}
    # Every rank verifies the manifests it reads; a tampered cache fails on all ranks alike.
    lat = store.read(up["latents"], LatentsManifest)
    txt = store.read(up["text"], TextManifest)
    scan_dir = store.version_dir("scan", lat.upstream["scan"])
    store.read(scan_dir, ScanManifest)
    records = {r["path"]: ImageRecord.model_validate(r) for r in read_jsonl(scan_dir / "images.jsonl")}
    return Run(cfg=cfg, rank=rank, world=world, device=device, family=get_family(cfg.model.family),
               model_dir=Path(spec["model_dir"]), out=Path(spec["out_dir"]),
               reader=LatentReader(up["latents"], lat), text=TextCache(up["text"], list(txt.fields)),
               records=records, scaling=lat.scaling_factor, shift=lat.shift_factor)


def fit(run: Run) -> tuple[torch.nn.Module, list[float]]:
    t = run.cfg.train
    fam = run.family
    torch.manual_seed(t.seed)  # identical initial weights on every rank before DDP broadcasts anyway
    denoiser = fam.load_denoiser(run.model_dir, torch.float32, run.device).train()
    model = DDP(denoiser, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.learning_rate,
                            weight_decay=t.weight_decay)
    scheduler = fam.load_noise_scheduler(run.model_dir)
    gen = torch.Generator().manual_seed(t.seed * 1000 + run.rank)  # per-rank noise, reproducible
    losses: list[float] = []
    step, epoch = 0, 0
    while step < t.steps:
        for bucket, rows in epoch_plan(run.reader.counts(), t.batch_size, run.world, t.seed, epoch):
            batch = run.reader.batch(bucket, rows[run.rank * t.batch_size:(run.rank + 1) * t.batch_size])
            loss = train_step(run, model, opt, scheduler, batch, gen)
            step += 1
            losses.append(loss)
            if run.rank == 0 and (step % 10 == 0 or step == t.steps):
                print(f"step {step}/{t.steps} loss {sum(losses[-10:]) / len(losses[-10:]):.4f}", flush=True)
            if step >= t.steps:
                break
        epoch += 1
    return denoiser, losses


def train_step(run: Run, model, opt, scheduler, batch, gen: torch.Generator) -> float:
    t, fam = run.cfg.train, run.family
    x0 = scale_latents(run.reader.sample(batch, gen), run.scaling, run.shift)
    captions = [run.records[p].caption for p in batch.paths]
    drop = torch.rand(len(captions), generator=gen) < t.caption_dropout
    captions = ["" if d else c for c, d in zip(captions, drop.tolist())]  # the cached empty caption
    cond = {k: v.to(run.device, torch.float32 if v.is_floating_point() else v.dtype)
            for k, v in run.text.get(captions).items()}
    noise = torch.randn(x0.shape, generator=gen)
    noisy, timesteps, target = noisy_and_target(x0, noise, fam.facts.prediction, scheduler, gen)
    pred = fam.denoise(model, noisy.to(run.device), timesteps.to(run.device), cond,
                       micro=[micro_cond(run.records[p]) for p in batch.paths])
    loss = torch.nn.functional.mse_loss(pred.float(), target.to(run.device).float())
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss is {loss.item()} at batch of images {list(batch.paths)[:4]}")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def save(run: Run, denoiser: torch.nn.Module, losses: list[float]) -> None:
    """Rank 0 writes; the others wait so nobody exits before the result exists."""
    if run.rank == 0:
        step = run.cfg.train.steps
        ckpt = run.out / "checkpoints" / f"step-{step:07d}"
        ckpt.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in denoiser.state_dict().items()}
        save_file(state, str(ckpt / "denoiser.safetensors"))
        run.family.save_pipeline(run.model_dir, denoiser, run.out / "final")
        write_jsonl(run.out / "losses.jsonl", ({"step": i + 1, "loss": v} for i, v in enumerate(losses)))
        result = {"family": run.family.facts.name, "mode": run.cfg.train.mode, "step": step,
                  "world_size": run.world, "checkpoint": str(ckpt.relative_to(run.out)),
                  "losses": [round(v, 6) for v in losses]}
        (run.out / "result.json").write_text(json.dumps(result), encoding="utf-8")
    dist.barrier()


def main(argv: list[str]) -> None:
    worker_guard()
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    run = setup(spec)
    try:
        denoiser, losses = fit(run)
        save(run, denoiser, losses)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
