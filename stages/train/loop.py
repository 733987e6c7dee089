"""One optimizer step at a time: micro-batches (gradient accumulation), autocast, loss weighting, clipping, EMA.

The Trainer holds no file paths and writes nothing; the worker around it decides what to save and when, and the
benchmark drives the same class in-process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tuneline.schemas.scan import ImageRecord
from tuneline.stages.common.prefetch import ahead
from tuneline.stages.families.base import MicroCond
from tuneline.stages.families.common import unwrap
from tuneline.stages.families.resolve import dtypes
from tuneline.stages.latents.controls import read as read_controls
from tuneline.stages.latents.masks import read as read_mask
from tuneline.stages.latents.reader import Batch, LatentReader
from tuneline.stages.text.live import LiveText
from tuneline.stages.text.store import TextCache, pair_key
from tuneline.stages.train import checkpoint as ckpt, collectives, dcp, fsdp, fsdpload
from tuneline.stages.train.ema import EMA
from tuneline.stages.train.feed import feed_workers, sample_latents, samples_in_feed
from tuneline.stages.train.model import attention_for_training, autocast_dtype, grad_scaler, prepare_denoiser
from tuneline.stages.train.objective import (
    loss_weights,
    noisy_and_target,
    offset_noise,
    prediction_type,
    scale_latents,
    weighted_mse,
)
from tuneline.stages.train.optimizers import build_optimizer, restore_state, set_lr, state_tensors
from tuneline.stages.train.plan import MicroBatch, Position, device_seed, shard, step_seed
from tuneline.stages.train.rows import RowPlan
from tuneline.stages.train.schedule import lr_at
from tuneline.stages.train.swap import block_swapper
from tuneline.stages.train.textlora import Joint, TrainedText
from tuneline.stages.train.timesteps import SigmaSampler


class NonFiniteLoss(FloatingPointError):
    """The loss went NaN/Inf: training stops without stepping, so the last checkpoint stays the last good one."""


@dataclass
class Data:
    """What training reads: the caches (never the images or the encoders)."""

    reader: LatentReader
    text: TextCache | LiveText | TrainedText  # same .get(captions, variant_ids) and .variants
    records: dict[str, ImageRecord]
    scaling: float | torch.Tensor  # (C, 1, 1) per channel: families.base.latent_affine
    shift: float | torch.Tensor
    sized: dict[tuple[str, str], ImageRecord] = field(default_factory=dict)  # (path, bucket) -> record
    rows: RowPlan | None = None  # which rows train, repeats, per-source loss weights

    def record(self, path: str, bucket: str) -> ImageRecord:
        """The record sized for this bucket: with buckets.resolutions an image has one per resolution."""
        return self.sized.get((path, bucket)) or self.records[path]


@dataclass
class Fed:
    """One micro-batch as the feed prepares it ahead of its step: what the step reads, on the CPU (pinned when the
    training device is a GPU), and the micro-batch's CPU generator after the feed's draws (flips, caption dropout,
    variants), from which the step goes on to draw timesteps. On a CPU training device the feed also samples the
    latents (`sampled`), leaving `dev`, the micro-batch's device generator, where the step continues drawing."""

    mb: MicroBatch
    index: int  # micro-batch index since the run's first step: seeds its generators
    gen: torch.Generator
    batch: Batch
    mean: torch.Tensor  # stored dtype
    std: torch.Tensor | None  # None with train.latent_sampling: mean
    cond: dict[str, torch.Tensor]
    sampled: torch.Tensor | None = None  # float32 latents on the training device, drawn from `dev`
    dev: torch.Generator | None = None
    strings: list[str] | None = None  # train.text_encoder_lora: the strings the step encodes (cond is empty)


def control_cond(fam, data, batch) -> dict[str, torch.Tensor]:
    """A paired dataset's conditioning for a family that takes control: the batch's control latents, scaled as the
    targets are (nothing without controls)."""
    control = read_controls(data.reader, batch) if fam.takes_control else None
    return {} if control is None else {"control_latents": scale_latents(control, data.scaling, data.shift)}


def micro_cond(rec: ImageRecord, flipped: bool = False) -> MicroCond:
    """SDXL-style size conditioning from the scan's record: original size, crop corner in bucket pixels, bucket.
    A flipped image's crop starts as far from the left edge as the unflipped crop ends from the right one."""
    left, top, right, _ = rec.crop
    scale = rec.bucket_width / max(1, right - left)
    if flipped:
        left = rec.width - right
    return MicroCond(
        original_size=(rec.height, rec.width),
        crop_top_left=(round(top * scale), round(left * scale)),
        target_size=(rec.bucket_height, rec.bucket_width),
    )


EARLY_STEPS = 10  # a non-finite loss within these steps blames the learning rate first


def seed_layers(device: torch.device, seed: int) -> None:
    """Seed what the denoiser's own random layers (dropout, if it has any) draw from: the CPU's generator and the
    training device's. torch.manual_seed would also queue a seeding of each accelerator kind not started in this
    process (CUDA, XPU, MTIA), capturing the stack for each: ~2 ms a micro-step on a CPU run."""
    torch.random.default_generator.manual_seed(seed)
    if device.type != "cpu":
        getattr(torch, device.type).manual_seed_all(seed)  # started by now: seeded at once


class Trainer:
    def __init__(
        self,
        cfg,
        fam,
        model_dir: Path,
        data: Data,
        rank: int,
        world: int,
        device: torch.device,
        resume: Path | None = None,
    ):
        self.cfg, self.t, self.fam, self.data, self.model_dir = cfg, cfg.train, fam, data, model_dir
        self.rank, self.world, self.device = rank, world, device
        self.autocast = autocast_dtype(self.t.mixed_precision, device, cfg.model.dtype, self.t.mode)
        attention_for_training(device)
        base = torch.float32 if device.type == "cpu" else dtypes()[cfg.model.dtype]
        self.sharded = fsdp.wanted(self.t)  # train.parallelism fsdp: sharded before the optimizer sees a weight
        # sharded: each rank loads its own shard only
        load = fsdpload.skeleton(fam, cfg.model.expert) if self.sharded else None
        shards = world if self.sharded else 1
        self.denoiser, self.params = prepare_denoiser(
            fam, model_dir, self.t, base, device, cfg.model.quantize, shards, load, cfg.model.expert
        )
        if self.sharded:
            self.params = fsdp.shard(self.denoiser, fam, self.t, device, self.autocast, model_dir)
        self.text = data.text if isinstance(data.text, TrainedText) else None  # train.text_encoder_lora
        if self.text is not None:
            self.params.update(self.text.params())
        self.names = list(self.params)
        self.swapper = block_swapper(fam, self.denoiser, self.t, device)  # before the optimizer, EMA and DDP
        self.opt = build_optimizer(self.param_groups(), self.t)
        self.scaler = grad_scaler(self.autocast)
        # On every rank (rank 0 saves it; under FSDP each rank its own shard): in-training validation renders the EMA weights on every rank.
        self.ema = EMA(self.params, self.t.ema_decay) if self.t.ema else None
        self.noise_scheduler = fam.load_noise_scheduler(model_dir)
        self.prediction = prediction_type(fam.facts.prediction, self.noise_scheduler, cfg.model.prediction_type)
        den = unwrap(self.denoiser)
        self.sigmas = SigmaSampler.from_train(self.t, fam.sigma_range(den), fam.sigma_splits(den))
        self.step, self.position, self.losses = 0, Position(), []
        if resume is not None:
            self.restore(resume)
        self.flags = torch.zeros(1, 0)  # every rank's stop/checkpoint flags of the last step (train_step)
        # Wrapped after the restore: wrapping broadcasts rank 0's trainable weights, so every rank (on every node)
        # must already hold the checkpoint's by then, or the ranks' optimizer states and weights would disagree.
        self.model = self.wrapped()

    def wrapped(self) -> torch.nn.Module:
        """The model a step calls: under DDP the wrapped denoiser (with a text-encoder LoRA, both: its reducer
        then averages both LoRAs' gradients); FSDP reduces the gradients itself."""
        if not collectives.active(self.world) or self.sharded:
            return self.denoiser
        joint = Joint(self.denoiser, self.text.enc.encoders) if self.text is not None else self.denoiser
        # Timestep experts: each step trains one (SigmaSampler.step_share), leaving the others without gradients.
        routed = len(self.fam.denoiser_parts(unwrap(self.denoiser))) > 1
        return collectives.wrap(joint, self.params, self.device, routed)

    def param_groups(self) -> list:
        """The optimizer's parameters: one group, or with train.text_encoder_lora a second for the text encoders
        whose rate is train.text_encoder_lr (kept as a ratio to the scheduled rate: optimizers.set_lr)."""
        if self.text is None:
            return list(self.params.values())
        te = set(self.text.params())
        t = self.t
        return [
            {"params": [p for n, p in self.params.items() if n not in te]},
            {
                "params": [p for n, p in self.params.items() if n in te],
                "lr_scale": (t.text_encoder_lr or t.learning_rate) / t.learning_rate,
            },
        ]

    # ---- one step ----------------------------------------------------------------------------
    def feed(self, stream: Iterator[MicroBatch]) -> Iterator[Fed]:
        """The micro-batches of `stream` prepared in a background thread, two optimizer steps' worth ahead, so the
        cache reads overlap the steps. Indices count from this trainer's current step (a resumed run continues
        them), so every draw is the one the uninterrupted run made."""
        first = self.step * self.t.grad_accumulation
        return ahead(
            ((first + i, mb) for i, mb in enumerate(stream)),
            lambda item: self.prepare(*item),
            workers=feed_workers(self.data.reader, self.device),
            depth=2 * self.t.grad_accumulation,
            name="train-feed",
        )

    def prepare(self, index: int, mb: MicroBatch) -> Fed:
        """Everything micro-batch `index` reads, drawn and read as the step would (thread-safe: it only reads)."""
        gen = torch.Generator().manual_seed(step_seed(self.t.seed, self.rank, index))
        batch = self.data.reader.batch(mb.bucket, mb.rows, self.flips(len(mb.rows), gen))
        pin = self.device.type == "cuda"  # page-locked: the step's copies to the GPU run asynchronously
        mean, std = self.data.reader.gather(batch, pin=pin)
        cond, strings = self.conditioning(batch.paths, gen)
        cond |= control_cond(self.fam, self.data, batch)
        if pin:
            cond = {k: v.pin_memory() if v.device.type == "cpu" else v for k, v in cond.items()}
        fed = Fed(mb, index, gen, batch, mean, None if self.t.latent_sampling == "mean" else std, cond)
        fed.strings = strings
        if samples_in_feed(self.device):
            self.sample(fed)
        return fed

    def sample(self, fed: Fed) -> None:
        """Draw the micro-batch's latents from its own device generator (the step's draws continue from it)."""
        fed.dev = torch.Generator(self.device).manual_seed(device_seed(self.t.seed, self.rank, fed.index))
        fed.sampled = sample_latents(fed.mean, fed.std, fed.dev)

    def train_step(self, micro: list[Fed], flags: list[float] | None = None) -> float:
        """Accumulate gradients over `micro`, check every rank's loss, step. Returns the mean loss. `flags` (this
        rank's stop/checkpoint flags) travel in the same all-reduce as the losses; every rank's land in
        `self.flags`."""
        last = len(micro) - 1
        local = [self.micro_step(fed, sync=m == last) for m, fed in enumerate(micro)]
        losses, self.flags = collectives.exchange(torch.stack(local), flags or [], self.rank, self.world)
        if not torch.isfinite(losses).all():
            raise NonFiniteLoss(self.describe_nonfinite(losses, [fed.mb for fed in micro]))
        self.optimizer_step()
        self.position = micro[-1].mb.after
        self.losses.append(float(losses.mean()))
        return self.losses[-1]

    def micro_step(self, fed: Fed, sync: bool) -> torch.Tensor:
        t, data, mb, batch, gen = self.t, self.data, fed.mb, fed.batch, fed.gen
        # Tensor-sized draws (latent eps, diffusion noise) on the training device, from its own generator.
        if fed.sampled is None:
            self.sample(fed)
        dev = fed.dev
        seed_layers(self.device, step_seed(t.seed, self.rank, fed.index))
        x0 = scale_latents(fed.sampled, data.scaling, data.shift)
        cond = {
            k: v.to(self.device, torch.float32 if v.is_floating_point() else v.dtype, non_blocking=True)
            for k, v in fed.cond.items()
        }
        noise = offset_noise(torch.randn(x0.shape, generator=dev, device=self.device), t.noise_offset, dev)
        nz = noisy_and_target(x0, noise, self.prediction, self.noise_scheduler, gen, **self.draws())
        weights = loss_weights(nz.snr, self.prediction, t.loss_weighting, t.min_snr_gamma)
        per_source = data.rows.loss_weights(mb.bucket, mb.rows) if data.rows is not None else None
        if per_source is not None:  # dataset.sources loss_weight (prior preservation)
            weights = weights * torch.tensor(per_source, dtype=weights.dtype)
        flip = batch.flip or (False,) * len(batch.paths)
        no_sync = self.model.no_sync() if isinstance(self.model, DDP) and not sync else nullcontext()
        amp = torch.autocast(self.device.type, self.autocast) if self.autocast else nullcontext()
        with no_sync:
            with amp:
                if fed.strings is not None:  # the trained text encoders, with gradients
                    cond = self.text.encode(fed.strings)
                pred = self.fam.denoise(
                    self.model,
                    nz.noisy.to(self.device),
                    nz.timesteps.to(self.device),
                    cond,
                    micro=[micro_cond(data.record(p, mb.bucket), f) for p, f in zip(batch.paths, flip)],
                )
            mask = read_mask(data.reader, batch) if t.masked_loss else None
            loss = weighted_mse(pred, nz.target.to(self.device), weights, mask)
            self.scaler.scale(loss / t.grad_accumulation).backward()
        return loss.detach()

    def draws(self) -> dict:
        """How a micro-batch draws its noise levels (noisy_and_target's keywords): with timestep experts in one
        expert's share per optimizer step, drawn from the seed and the step only (not the micro-batch's size), so under FSDP
        and block swap every rank and micro-step runs the same expert's blocks (SigmaSampler.step_share)."""
        share = self.sigmas.step_share(self.t.seed, self.step, self.noise_scheduler.config)
        return {"sigmas": self.sigmas, "patch": self.fam.facts.patch_size, "within": share}

    def flips(self, n: int, gen: torch.Generator) -> list[bool] | None:
        if not (self.t.flip and self.data.reader.manifest.flip):
            return None
        return (torch.rand(n, generator=gen) < 0.5).tolist()

    def conditioning(
        self, paths: tuple[str, ...], gen: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], list[str] | None]:
        """Text tensors for the batch's captions (as the text source holds them), each sample a random one of the
        cached variants (tag shuffles); caption dropout reads the cached empty caption. With trained text
        encoders: no tensors, the strings the step encodes (the same draws)."""
        captions = [self.data.records[p].caption for p in paths]
        drop = torch.rand(len(captions), generator=gen) < self.t.caption_dropout
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        if getattr(self.data.text, "paired", False):  # rows per (instruction, control image): Qwen-Image-Edit
            captions = [pair_key(c, self.data.records[p].control_sha256) for c, p in zip(captions, paths)]
        variants = torch.randint(0, self.data.text.variants, (len(captions),), generator=gen).tolist()
        if self.text is not None:
            return {}, self.text.strings(captions, variants)
        return self.data.text.get(captions, variants), None

    def optimizer_step(self) -> None:
        t = self.t
        lr = lr_at(self.step, t.learning_rate, t.lr_schedule, t.effective_warmup(), t.steps)
        set_lr(self.opt, lr)
        if self.swapper is not None and self.swapper.full:
            self.swapper.home()  # swapped full-fine-tune weights step on the CPU
        if t.max_grad_norm:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), t.max_grad_norm)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.params, self.step)
        self.step += 1

    def describe_nonfinite(self, losses: torch.Tensor, micro: list[MicroBatch]) -> str:
        rank, m = (int(i) for i in (~torch.isfinite(losses)).nonzero()[0])
        mb = micro[m]
        rows = shard(mb.global_rows, rank, self.t.batch_size)
        paths = self.data.reader.batch(mb.bucket, rows).paths
        where = f"loss is {losses[rank, m].item()} at step {self.step + 1} (rank {rank}, micro-batch {m}, bucket {mb.bucket})"
        if self.step < EARLY_STEPS:  # images that passed the scan and the cache's checks rarely do this at once
            return (
                f"{where}: this early, the likelier cause is train.learning_rate {self.t.learning_rate} (train.optimizer "
                f"{self.t.optimizer}): lower it tenfold; if that does not help, the batch's images: {', '.join(paths)}"
            )
        return f"{where}; the batch's images: {', '.join(paths)}"

    # ---- checkpoints -------------------------------------------------------------------------
    def checkpoint(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """(tensors by file, JSON state) of everything a resumed run needs to continue exactly."""
        t = self.t
        opt_tensors, opt_meta = state_tensors(self.opt, self.names)
        tensors = {"trainable": {n: p.detach() for n, p in self.params.items()}, "optimizer": opt_tensors}
        if self.ema is not None:
            tensors["ema"] = self.ema.shadow
        state = {
            "position": self.position.as_json(),
            "losses": self.losses,
            "world_size": self.world,
            "batch_size": t.batch_size,
            "grad_accumulation": t.grad_accumulation,
            "mode": t.mode,
            "family": self.fam.facts.name,
            "made_with": ckpt.made_with(self.cfg),
            "seed": t.seed,
            "optimizer": opt_meta,
            "lr": float(self.opt.param_groups[0]["lr"]),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema is not None,
            "rng": "derived per micro-batch from (seed, rank, micro-batch index): see tuneline.stages.train.plan",
        }
        return tensors, state

    def restore(self, path: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, grad scaler, EMA, step, sampler position, losses."""
        state, tensors = dcp.load(path, self) if dcp.is_sharded(path) else ckpt.load(path)
        self.check_compatible(path, state, set(tensors.get("trainable", {})))
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(tensors["trainable"][n])
        restore_state(self.opt, self.names, tensors.get("optimizer", {}), state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            self.ema.shadow = {n: v.to(self.device) for n, v in tensors.get("ema", tensors["trainable"]).items()}
        self.step, self.position, self.losses = state["step"], dcp.position(state, self.t, self.world), state["losses"]

    def check_compatible(self, path: Path, state: dict, names: set[str]) -> None:
        t = self.t
        mine = {"mode": t.mode, "family": self.fam.facts.name} | dcp.batch_facts(state, t, self.world)
        differ = [f"{k} {state.get(k)!r} (now {v!r})" for k, v in mine.items() if state.get(k) != v]
        if names != set(self.names):
            differ.append(f"{len(names)} trained tensors that do not match this model's {len(self.names)}")
        if state.get("step", 0) > t.steps:
            differ.append(f"step {state.get('step')} beyond train.steps {t.steps}")
        if differ:
            raise ckpt.CheckpointError(
                f"checkpoint {path} cannot continue this run: it has "
                + "; ".join(differ)
                + "; resume with the settings it was made with, or set train.resume to null"
            )
