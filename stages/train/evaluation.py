"""Held-out eval loss (train.eval): the loss of the held-out rows (tuneline.stages.train.rows) at fixed timesteps and noise.

The noise is seeded by the image and the timestep, so two evaluations of the same weights give the same number
and curves compare across runs. A paired dataset's rows are denoised with their control latents, as in training.

Every rank evaluates its share: the held-out rows in batches of train.batch_size per bucket, the batches dealt out
round-robin, each sample's loss summed, and the sums all-reduced, so the number is the one a single process gets.
The forwards run on the unwrapped denoiser (no DDP hook). Under train.parallelism fsdp each forward all-gathers
the sharded weights from every rank, so every rank runs the same forwards: a share one batch short is padded with
the first batch, whose losses are dropped.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from tuneline.stages.families.common import unwrap
from tuneline.stages.text.store import pair_key
from tuneline.stages.train import collectives, fsdp
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


def trained_timesteps(trainer: Trainer, timesteps: list[int]) -> list[int]:
    """Those of `timesteps` in the noise levels the run trains (a timestep expert's share: Family.sigma_range), as
    the expert routing reads them (t >= boundary * 1000 is the high-noise expert's); ValueError naming the fix
    where none is (the config check sees only the shipped folder's boundary)."""
    lo, hi = trainer.fam.sigma_range(unwrap(trainer.denoiser))
    kept = [t for t in timesteps if lo * 1000 <= t and (t < hi * 1000 or hi >= 1.0)]
    if not kept:
        raise ValueError(
            f"train.eval.timesteps {timesteps}: none is in the noise levels this run trains (t from {lo * 1000:g} "
            f"to {hi * 1000:g}, model.expert {trainer.cfg.model.expert}); set train.eval.timesteps inside them, "
            f"e.g. [{round(lo * 1000 + (hi - lo) * 500)}]"
        )
    return kept


class Evaluator:
    """Mean squared error of the held-out images at each of `timesteps`, on the cached latent means."""

    def __init__(self, trainer: Trainer, held: Rows, timesteps: list[int], batch_size: int = 1):
        self.trainer, self.timesteps = trainer, trained_timesteps(trainer, timesteps)
        batches = [
            (bucket, rows[i : i + batch_size])
            for bucket, rows in sorted(held.items())
            for i in range(0, len(rows), batch_size)
        ]
        mine = batches[trainer.rank :: trainer.world]
        padding = -(-len(batches) // trainer.world) - len(mine)
        self.share = [(*b, True) for b in mine] + [(*batches[0], False)] * padding  # (bucket, rows, counted)

    @torch.no_grad()
    def evaluate(self) -> dict:
        tr = self.trainer
        model, was_training = tr.denoiser, tr.denoiser.training
        model.eval()  # dropout off: the same weights must give the same number
        sums = torch.zeros(len(self.timesteps) + 1, dtype=torch.float64)  # per timestep, then the sample count
        try:
            # schedule-free: the averaged weights it exports (tuneline.stages.train.optimizers.eval_weights)
            with eval_weights(tr.opt, tr.params):
                for bucket, rows, counted in self.share:
                    losses = self._batch(bucket, rows)
                    sums += losses if counted else 0
        finally:
            fsdp.reshard(model)  # the next forward gathers the training weights, not schedule-free's average
            model.train(was_training)
        sums = collectives.sum_over_ranks(sums, tr.device, tr.world).tolist()
        n = sums[-1]
        per_t = {str(t): round(s / n, 6) for t, s in zip(self.timesteps, sums)}
        loss = round(sum(s / n for s in sums[:-1]) / len(self.timesteps), 6)
        return {"step": tr.step, "loss": loss, "per_timestep": per_t}

    def _batch(self, bucket: str, rows: np.ndarray) -> torch.Tensor:
        """(per timestep the sum of the batch's per-sample losses, the batch's size)."""
        tr, data = self.trainer, self.trainer.data
        batch = data.reader.batch(bucket, rows)
        x0 = scale_latents(data.reader.gather(batch)[0].float(), data.scaling, data.shift)
        captions = [data.records[p].caption for p in batch.paths]
        if getattr(data.text, "paired", False):  # rows per (instruction, control image)
            captions = [pair_key(c, data.records[p].control_sha256) for c, p in zip(captions, batch.paths)]
        cond = {
            k: v.to(tr.device, torch.float32 if v.is_floating_point() else v.dtype)
            for k, v in (data.text.get(captions, [0] * len(captions)) | control_cond(tr.fam, data, batch)).items()
        }
        micro = [micro_cond(data.record(p, bucket)) for p in batch.paths]
        out = []
        for t in self.timesteps:
            noise = torch.stack([_noise(p, t, tuple(x0.shape[1:])) for p in batch.paths])
            noisy, ts, target = _noised(x0, noise, t, tr.fam.facts.prediction, tr.noise_scheduler)
            pred = tr.fam.denoise(tr.denoiser, noisy.to(tr.device), ts.to(tr.device), cond, micro=micro)
            err = (pred.float() - target.to(tr.device).float()) ** 2
            out.append(float(err.reshape(len(rows), -1).mean(dim=1).double().sum()))
        return torch.tensor(out + [len(rows)], dtype=torch.float64)
