"""Training objectives as small pure functions: noising and the target each prediction type learns."""
from __future__ import annotations

import torch


def scale_latents(x: torch.Tensor, scaling: float, shift: float) -> torch.Tensor:
    """Cached latents are the VAE's raw distribution; the denoiser sees (z - shift) * scale."""
    return (x - shift) * scaling


def noisy_and_target(x0: torch.Tensor, noise: torch.Tensor, prediction: str, scheduler,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy latents, timesteps, target) for one batch.

    epsilon / v_prediction: DDPM timesteps in [0, T) and the scheduler's own noising.
    flow_matching: sigma ~ U(0, 1), x_t = (1 - sigma) x0 + sigma noise, target = noise - x0, and the
    timestep passed on is sigma * 1000 (the convention family adapters expect).
    """
    b = x0.shape[0]
    if prediction == "flow_matching":
        sigma = torch.rand(b, generator=generator)
        s = sigma.view(b, *([1] * (x0.dim() - 1)))
        return (1 - s) * x0 + s * noise, sigma * 1000.0, noise - x0
    steps = scheduler.config.num_train_timesteps
    t = torch.randint(0, steps, (b,), generator=generator)
    noisy = scheduler.add_noise(x0, noise, t)
    if prediction == "epsilon":
        return noisy, t, noise
    if prediction == "v_prediction":
        return noisy, t, scheduler.get_velocity(x0, noise, t)
    raise ValueError(f"unknown prediction type {prediction!r}")
