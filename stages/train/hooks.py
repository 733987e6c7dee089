"""What happens between optimizer steps: progress lines, checkpoints, in-training validation.

Only rank 0 writes files. In-training validation renders on every rank (its share of the prompts).
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch
from PIL import Image

from tuneline.stages.families.resolve import dtypes, input_area
from tuneline.stages.render.renderer import Renderer, Sample, grid, render_size_for
from tuneline.stages.text import effective_max_length
from tuneline.stages.train import checkpoint as ckpt, collectives, dcp, fsdp
from tuneline.stages.train.checkpoint import CHECKPOINTS
from tuneline.stages.train.loop import Trainer
from tuneline.stages.train.optimizers import eval_weights
from tuneline.stages.train.pace import PaceMeter, duration

LOG_EVERY = 10
SAMPLES = "samples"


class Hooks:
    def __init__(self, run, trainer: Trainer):
        self.run, self.trainer, self.t = run, trainer, run.cfg.train
        self.last_checkpoint = trainer.step  # the step of the newest checkpoint (a resumed run starts at one)
        self.logged = (trainer.step, time.monotonic())  # the last step line: (step, when)
        self.meter = PaceMeter(trainer.step, run.cfg.train.steps)

    def before_step(self) -> None:
        self.meter.start()

    @property
    def writer(self) -> bool:
        return self.run.rank == 0

    def after_step(self) -> None:
        self.meter.stop()
        step, t = self.trainer.step, self.t
        last = step == t.steps
        early = self.meter.early_line(step)
        if self.writer and early:
            print(early, flush=True)
        if self.writer and (step % LOG_EVERY == 0 or last):
            recent = self.trainer.losses[-LOG_EVERY:]
            lr = self.trainer.opt.param_groups[0]["lr"]
            print(
                f"step {step}/{t.steps} loss {sum(recent) / len(recent):.4f} lr {lr:.3g} {self.pace(step)}", flush=True
            )
        # Checkpoint first: a render that crashes (a bad validation setting, a full disk) must not take the step
        # with it, or every rerun would train the same steps again.
        if step % t.effective_checkpoint_every() == 0 or last:
            self.checkpoint()
        every = t.effective_validate_every()
        if every and (step % every == 0 or last):
            self.validate()

    def pace(self, step: int) -> str:
        """Steps per second since the last step line (checkpoints and sample renders in between included, as
        they are part of the wait) and the time left at that pace."""
        (before, then), now = self.logged, time.monotonic()
        self.logged = (step, now)
        rate = (step - before) / max(now - then, 1e-9)
        return f"({rate:.2f} steps/s, {duration(max(0, self.t.steps - step) / rate)} left)"

    def checkpoint(self) -> None:
        self.last_checkpoint = self.trainer.step
        root = self.run.out / CHECKPOINTS
        if self.trainer.sharded:  # every rank writes its shards (tuneline.stages.train.dcp)
            path = dcp.save(root, self.trainer.step, *self.trainer.checkpoint(), rank=self.run.rank)
        if not self.writer:
            return
        if not self.trainer.sharded:
            path = ckpt.save(root, self.trainer.step, *self.trainer.checkpoint())
        ckpt.prune(root, self.t.keep_checkpoints)
        print(f"checkpoint {path.relative_to(self.run.out)}", flush=True)

    def validate(self) -> None:
        """Render the validation prompts with the live (or EMA) weights into samples/step-N.png: every rank its
        share (`deal`), so that every rank makes the same renderer calls; rank 0 gathers the images and writes the
        grid."""
        tr, cfg = self.trainer, self.run.cfg
        v = cfg.validate_
        samples = [Sample(p.prompt, p.negative_prompt, p.seed) for p in v.prompts]
        world, rank = self.run.world, self.run.rank
        shares = deal(samples, world)
        mine = [samples[i] for i, _ in shares[rank]]
        rendered = [np.asarray(im) for im in self.render(mine)] if mine else []
        every = collectives.everyones(rendered, world)
        if not self.writer:
            return
        images: list = [None] * len(samples)
        for share, got in zip(shares, every):
            for (i, kept), pixels in zip(share, got):
                if kept:
                    images[i] = Image.fromarray(pixels)
        out = self.run.out / SAMPLES / f"step-{tr.step:07d}.png"
        out.parent.mkdir(exist_ok=True)
        grid(images).save(out)
        print(f"validation grid {out.relative_to(self.run.out)}", flush=True)

    def render(self, samples: list[Sample]) -> list:
        """`samples` rendered with the live weights. The pipeline must compute in the live denoiser's dtype, or in
        autocast when training uses it. It reuses the training denoiser; the VAE decoder and text encoders are
        loaded for this render only and freed after it, so training itself never holds them (for SD3/Flux they
        are tens of GB)."""
        tr, cfg = self.trainer, self.run.cfg
        dtype = dtypes()[cfg.model.dtype] if tr.autocast else torch.float32
        renderer = Renderer.load(
            tr.fam,
            self.run.model_dir,
            tr.device,
            dtype,
            denoiser=tr.denoiser,
            autocast=tr.autocast,
            max_length=effective_max_length(cfg),
            input_area=input_area(cfg),
        )
        if tr.text is not None:  # train.text_encoder_lora: prompts encoded by the encoders being trained
            renderer.enc = tr.text.enc
        v = cfg.validate_
        tr.denoiser.eval()
        try:
            with tr.ema.applied(tr.params) if tr.ema is not None else eval_weights(tr.opt, tr.params):
                return renderer.render(samples, *render_size_for(cfg), v.steps, v.guidance_scale)
        finally:
            fsdp.reshard(tr.denoiser)  # the next forward gathers the restored weights, not the rendered ones
            tr.denoiser.train()
            del renderer
            gc.collect()
            if tr.device.type == "cuda":
                torch.cuda.empty_cache()


def deal(samples: list[Sample], world: int) -> list[list[tuple[int, bool]]]:
    """Each rank's share of the validation samples as (index, kept) pairs. The renderer makes one call per kind
    (with and without a negative prompt, stages/render/renderer.py) and a kind may run more denoiser forwards per
    step; under FSDP every forward waits for every rank, so each kind is dealt round-robin apart and padded to the
    same count on every rank (padding is rendered, then dropped)."""
    shares: list[list[tuple[int, bool]]] = [[] for _ in range(world)]
    for negative in (False, True):
        kind = [i for i, s in enumerate(samples) if bool(s.negative_prompt) == negative]
        if not kind:
            continue
        per_rank = -(-len(kind) // world)
        for rank, share in enumerate(shares):
            mine = [(i, True) for i in kind[rank::world]]
            share += mine + [(kind[-1], False)] * (per_rank - len(mine))
    return shares
