"""Training objectives as small pure functions: noising, the target each prediction type learns, loss weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# scale_latents lives with the families (validate uses it too); it is part of the training objective's interface.
from tuneline.stages.families.base import scale_latents as scale_latents
from tuneline.stages.train.timesteps import SigmaSampler


@dataclass(frozen=True)
class Noised:
    noisy: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor
    snr: torch.Tensor  # per-sample signal-to-noise ratio (alpha^2 / sigma^2), for loss weighting


def offset_noise(noise: torch.Tensor, offset: float, generator: torch.Generator) -> torch.Tensor:
    """Noise offset: a per-sample, per-channel constant added to the noise, so the model can learn to shift an
    image's overall brightness (plain Gaussian noise never changes the mean of a large image much)."""
    if offset <= 0:
        return noise
    b, c = noise.shape[:2]
    shift = torch.randn((b, c, *([1] * (noise.dim() - 2))), generator=generator, device=noise.device)
    return noise + offset * shift


def prediction_type(family_default: str, scheduler, override: str = "auto") -> str:
    """What the denoiser learns to predict: `model.prediction_type` when set, else the model's own scheduler config
    (an SD2.x or v-prediction SDXL checkpoint says v_prediction there), else the family's default. Flow-matching
    families always learn the velocity of the flow."""
    if family_default == "flow_matching":
        return family_default
    if override != "auto":
        return override
    return getattr(scheduler.config, "prediction_type", None) or family_default


def noisy_and_target(
    x0: torch.Tensor,
    noise: torch.Tensor,
    prediction: str,
    scheduler,
    generator: torch.Generator,
    *,
    sigmas: SigmaSampler | None = None,
    patch: int = 1,
    within: tuple[float, float] | None = None,
) -> Noised:
    """Noise one batch and name what the model must predict.

    epsilon / v_prediction: DDPM timesteps in [0, T) and the scheduler's own noising.
    flow_matching: sigma from `sigmas` (tuneline.stages.train.timesteps; default U(0, 1) unshifted), x_t = (1 - sigma) x0 +
    sigma noise, target = noise - x0, and the timestep passed on is sigma * 1000 (the convention family adapters
    expect). `patch` is the denoiser's patch size: the image's token count sets a resolution-dependent shift.
    `within`: the step's share of the noise levels (SigmaSampler.step_share), where a timestep expert takes over.
    """
    b = x0.shape[0]
    if prediction == "flow_matching":
        if sigmas is None:
            sigma = torch.rand(b, generator=generator)
        else:
            tokens = (x0.shape[-2] // patch) * (x0.shape[-1] // patch)
            sigma = sigmas.sample(b, generator, scheduler.config if scheduler is not None else {}, tokens, within)
        s = sigma.view(b, *([1] * (x0.dim() - 1))).to(x0.device)
        snr = ((1 - sigma) / sigma.clamp_min(1e-6)) ** 2
        return Noised((1 - s) * x0 + s * noise, sigma * 1000.0, noise - x0, snr)
    steps = scheduler.config.num_train_timesteps
    t = torch.randint(0, steps, (b,), generator=generator)
    noisy = scheduler.add_noise(x0, noise, t)
    alpha_bar = scheduler.alphas_cumprod[t].float()
    snr = alpha_bar / (1 - alpha_bar)
    if prediction == "epsilon":
        return Noised(noisy, t, noise, snr)
    if prediction == "v_prediction":
        return Noised(noisy, t, scheduler.get_velocity(x0, noise, t), snr)
    raise ValueError(f"unknown prediction type {prediction!r}")


def loss_weights(snr: torch.Tensor, prediction: str, weighting: str, gamma: float) -> torch.Tensor:
    """Per-sample loss weights.

    min_snr (Hang et al. 2023): weight the equivalent x0-loss by min(SNR, gamma), expressed for the target the
    model learns: epsilon -> min(snr, g) / snr; v -> min(snr, g) / (snr + 1). Flow-matching families train
    unweighted (the config refuses min_snr for them, schemas/checks.py).
    """
    if weighting == "auto":  # min-SNR where it is meant for (epsilon/v); flow matching trains unweighted
        weighting = "none" if prediction == "flow_matching" else "min_snr"
    if weighting == "none":
        return torch.ones_like(snr)
    if weighting != "min_snr":
        raise ValueError(f"unknown loss weighting {weighting!r}")
    clipped = snr.clamp(max=gamma)
    if prediction == "epsilon":
        return clipped / snr.clamp_min(1e-8)
    if prediction == "v_prediction":
        return clipped / (snr + 1)
    raise ValueError(f"min_snr weighting is defined for epsilon and v_prediction, not {prediction!r}")


def weighted_mse(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over each sample's elements, then the weighted mean over the batch (float32 whatever autocast did).

    `mask` (B, 1, h, w) in [0, 1] scales each latent position's error (masked loss); a zero mask adds nothing.
    """
    err = (pred.float() - target.float()) ** 2
    if mask is not None:
        err = err * mask.to(err.device)
    per_sample = err.flatten(1).mean(dim=1)
    return (per_sample * weights.to(per_sample.device)).mean()
