"""Held-out eval loss (train.eval): the loss of the held-out rows (tuneline.stages.train.rows) at fixed timesteps and noise.

The noise is seeded by the image and the timestep, so two evaluations of the same weights give the same number
and curves compare across runs. A paired dataset's rows are denoised with their control latents, as in training.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from tuneline.stages.text.store import pair_key
from tuneline.stages.train.loop import Trainer, control_cond, micro_cond
from tuneline.stages.train.objective import scale_latents
from tuneline.stages.train.optimizers import eval_weights
from tuneline.stages.train.rows import Rows


def _noise(path: str, t: int, shape: tuple[int, ...]) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{path}:{t}".encode()).digest()[:8], "big") >> 1
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _noised(x0: torch.Tensor, noise: torch.Tensor, t: int, prediction: str, scheduler):
    """(noisy, timesteps, target) at one fixed timestep; the same conventions as objective.noisy_and_target."""
    b = x0.shape[0]
    if prediction == "flow_matching":
        sigma = t / 1000.0
        return (1 - sigma) * x0 + sigma * noise, torch.full((b,), sigma * 1000.0), noise - x0
    ts = torch.full((b,), t, dtype=torch.long)
    noisy = scheduler.add_noise(x0, noise, ts)
    target = scheduler.get_velocity(x0, noise, ts) if prediction == "v_prediction" else noise
    return noisy, ts, target


class Evaluator:
    """Mean squared error of the held-out images at each of `timesteps`, on the cached latent means."""

    def __init__(self, trainer: Trainer, held: Rows, timesteps: list[int]):
        self.trainer, self.held, self.timesteps = trainer, held, timesteps

    @torch.no_grad()
    def evaluate(self) -> dict:
        tr, data = self.trainer, self.trainer.data
        model, was_training = tr.denoiser, tr.denoiser.training
        model.eval()  # dropout off: the same weights must give the same number
        sums = dict.fromkeys(self.timesteps, 0.0)
        n = 0
        # schedule-free: the averaged weights it exports (tuneline.stages.train.optimizers.eval_weights)
        with eval_weights(tr.opt, tr.params):
            n = self._sum(tr, data, model, was_training, sums)
        per_t = {str(t): round(s / n, 6) for t, s in sums.items()}
        return {"step": tr.step, "loss": round(sum(s / n for s in sums.values()) / len(sums), 6), "per_timestep": per_t}

    def _sum(self, tr, data, model, was_training, sums) -> int:
        n = 0
        try:
            for bucket, rows in self.held.items():
                for row in rows:
                    batch = data.reader.batch(bucket, np.array([row]))
                    x0 = scale_latents(data.reader.gather(batch)[0].float(), data.scaling, data.shift)
                    path = batch.paths[0]
                    caption = data.records[path].caption
                    if getattr(data.text, "paired", False):  # rows per (instruction, control image)
                        caption = pair_key(caption, data.records[path].control_sha256)
                    cond = {
                        k: v.to(tr.device, torch.float32 if v.is_floating_point() else v.dtype)
                        for k, v in (data.text.get([caption], [0]) | control_cond(tr.fam, data, batch)).items()
                    }
                    for t in self.timesteps:
                        noisy, ts, target = _noised(
                            x0, _noise(path, t, tuple(x0.shape)), t, tr.fam.facts.prediction, tr.noise_scheduler
                        )
                        pred = tr.fam.denoise(
                            model,
                            noisy.to(tr.device),
                            ts.to(tr.device),
                            cond,
                            micro=[micro_cond(data.record(path, bucket))],
                        )
                        sums[t] += float(((pred.float() - target.to(tr.device).float()) ** 2).mean())
                    n += 1
        finally:
            model.train(was_training)
        return n
