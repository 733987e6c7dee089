"""Where on the noise schedule flow-matching training samples (SD3, Flux): the distribution of sigma and its shift.

sigma in (0, 1) is the noise fraction: x_t = (1 - sigma) x0 + sigma noise. Samplers (Esser et al. 2024, "Scaling
Rectified Flow Transformers", section 3.1; the names sd-scripts and SimpleTuner use):
- uniform: sigma ~ U(0, 1);
- logit_normal: logit(sigma) ~ N(mean, std), most samples mid-schedule;
- sigmoid: sigma = sigmoid(scale * N(0, 1)), which is logit_normal with mean 0 and std `scale` (drawn as that);
- mode: sigma = 1 - u - s (cos^2(pi u / 2) - 1 + u), u ~ U(0, 1), heavier in the middle for s > 0.
Then the shift: sigma' = shift sigma / (1 + (shift - 1) sigma), moving samples towards noise, which matters more as
images grow. `auto` takes the model's own scheduler config: a fixed `shift` (SD3: 3.0), or with
`use_dynamic_shifting` (Flux) shift = exp(mu), mu linear in the image's token count between base_shift at
base_image_seq_len and max_shift at max_image_seq_len (diffusers' FluxPipeline `calculate_shift`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# The token count a step's expert share is drawn for (a 1024x1024 image in 16-pixel patches): a run-wide constant,
# since the micro-batch's own count can differ between ranks and accumulation micro-steps (buckets, clip sizes), and
# every one of them must run the same expert in a step (FSDP collectives, block swap's one resident expert).
SHARE_TOKENS = 4096


@dataclass(frozen=True)
class SigmaSampler:
    kind: str = "uniform"  # uniform | logit_normal | mode (train.timestep_sampling sigmoid is logit_normal)
    mean: float = 0.0
    std: float = 1.0
    mode_scale: float = 1.29
    shift: float | None = None  # None: resolution-dependent, from the scheduler config (auto)
    # The noise levels drawn, [lo, hi]: a timestep expert trains only its share (Family.sigma_range).
    span: tuple[float, float] = (0.0, 1.0)
    # Where the denoiser hands over from one timestep expert to the next (Family.sigma_splits): each step draws
    # every rank's sigmas between the same two (step_share), so every rank runs the same expert.
    splits: tuple[float, ...] = ()

    @classmethod
    def from_train(cls, t, span: tuple[float, float] = (0.0, 1.0), splits: tuple[float, ...] = ()) -> SigmaSampler:
        shift = None if t.timestep_shift == "auto" else float(t.timestep_shift)
        if t.timestep_sampling == "sigmoid":
            return cls("logit_normal", 0.0, t.sigmoid_scale, t.mode_scale, shift, span, splits)
        return cls(t.timestep_sampling, t.logit_mean, t.logit_std, t.mode_scale, shift, span, splits)

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n unshifted sigmas in (0, 1)."""
        if self.kind == "uniform":
            return torch.rand(n, generator=generator)
        if self.kind == "logit_normal":
            return torch.sigmoid(self.mean + self.std * torch.randn(n, generator=generator))
        if self.kind == "mode":
            u = torch.rand(n, generator=generator)
            return 1 - u - self.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
        raise ValueError(f"train.timestep_sampling: unknown sampler {self.kind!r}")

    def sample(
        self,
        n: int,
        generator: torch.Generator,
        scheduler_config,
        tokens: int,
        within: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """n sigmas for images of `tokens` latent patches, shifted as configured, then scaled into `span` (an
        expert's share keeps the sampler's shape within it, as musubi-tuner's timestep bounds do). `within`
        [lo, hi): only those, drawn until n fall there (the distribution conditioned on that share)."""
        shift = self.shift if self.shift is not None else auto_shift(scheduler_config, tokens)
        lo, hi = self.span
        if within is None:
            return lo + (hi - lo) * shift_sigmas(self.draw(n, generator), shift)
        kept = torch.empty(0)
        while len(kept) < n:
            s = self.sample(max(n, 64), generator, scheduler_config, tokens)
            kept = torch.cat([kept, s[(s >= within[0]) & (s < within[1])]])
        return kept[:n]

    def step_share(self, seed: int, step: int, scheduler_config) -> tuple[float, float] | None:
        """The share between `splits` that optimizer step `step` draws in, a function of (seed, step) and the run's
        constants only, so the same on every rank and micro-step (and in a resumed run): the one a sigma drawn as
        `sample` does for SHARE_TOKENS tokens (from a generator of the seed and the step) falls into. So each share
        gets the steps its mass under the sampler gives it, and a share's sigmas, drawn `within` it, follow the
        sampler there: over many steps the sigmas are distributed as `sample`'s, only the samples of one step share
        a side. With a resolution-dependent shift (use_dynamic_shifting) the share masses are those at SHARE_TOKENS,
        not at each image's size. (On average k draws per sample with k shares: a share of mass p is picked with
        probability p and costs 1/p draws.) None without splits."""
        if not self.splits:
            return None
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step, 2]).generate_state(1)[0]))
        sigma = float(self.sample(1, gen, scheduler_config, SHARE_TOKENS))
        edges = (0.0, *self.splits, 1.0 + 1e-9)  # sigma 1.0 belongs to the last share (t >= boundary)
        return next((lo, hi) for lo, hi in zip(edges, edges[1:]) if lo <= sigma < hi)


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * sigma / (1 + (shift - 1) * sigma)


def auto_shift(config, tokens: int) -> float:
    """The model's own shift for an image of `tokens` patches (1.0 when its scheduler has none)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    if not get("use_dynamic_shifting", False):
        return float(get("shift", 1.0) or 1.0)
    lo_n, hi_n = get("base_image_seq_len", 256), get("max_image_seq_len", 4096)
    lo, hi = get("base_shift", 0.5), get("max_shift", 1.15)
    mu = lo + (hi - lo) * (tokens - lo_n) / (hi_n - lo_n)
    return math.exp(mu)
