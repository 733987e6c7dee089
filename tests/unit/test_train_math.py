"""Pure training maths: noising targets, loss weights, noise offset, LR schedules, EMA, sampler plan, config
intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tuneline.schemas.config import parse_config
from tuneline.stages.train.ema import EMA
from tuneline.stages.train.objective import loss_weights, noisy_and_target, offset_noise, weighted_mse
from tuneline.stages.train.plan import MicroBatch, Position, micro_batches, shard, step_seed
from tuneline.stages.train.schedule import lr_at


@pytest.fixture(scope="module")
def ddpm():
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


def test_epsilon_and_v_targets(ddpm):
    x0, noise = torch.randn(4, 4, 8, 8), torch.randn(4, 4, 8, 8)
    eps = noisy_and_target(x0, noise, "epsilon", ddpm, torch.Generator().manual_seed(0))
    assert torch.equal(eps.target, noise)
    ab = ddpm.alphas_cumprod[eps.timesteps].view(-1, 1, 1, 1)
    assert torch.allclose(eps.noisy, ab.sqrt() * x0 + (1 - ab).sqrt() * noise, atol=1e-5)
    assert torch.allclose(eps.snr, (ab / (1 - ab)).flatten())
    v = noisy_and_target(x0, noise, "v_prediction", ddpm, torch.Generator().manual_seed(0))
    assert torch.allclose(v.target, ab.sqrt() * noise - (1 - ab).sqrt() * x0, atol=1e-5)


def test_flow_matching_target():
    x0, noise = torch.randn(3, 16, 4, 4), torch.randn(3, 16, 4, 4)
    out = noisy_and_target(x0, noise, "flow_matching", None, torch.Generator().manual_seed(1))
    sigma = (out.timesteps / 1000).view(-1, 1, 1, 1)
    assert torch.allclose(out.noisy, (1 - sigma) * x0 + sigma * noise)
    assert torch.equal(out.target, noise - x0)
    assert ((out.timesteps >= 0) & (out.timesteps < 1000)).all()


def test_unknown_prediction_is_refused(ddpm):
    with pytest.raises(ValueError, match="prediction"):
        noisy_and_target(torch.zeros(1, 4, 2, 2), torch.zeros(1, 4, 2, 2), "sample", ddpm, torch.Generator())


def test_min_snr_weights():
    snr = torch.tensor([0.5, 5.0, 50.0])
    assert torch.equal(loss_weights(snr, "epsilon", "none", 5.0), torch.ones(3))
    assert torch.allclose(loss_weights(snr, "epsilon", "min_snr", 5.0), torch.tensor([1.0, 1.0, 0.1]))
    assert torch.allclose(loss_weights(snr, "v_prediction", "min_snr", 5.0), torch.tensor([0.5 / 1.5, 5 / 6, 5 / 51]))
    with pytest.raises(ValueError, match="min_snr"):  # refused at load for flow-matching families
        loss_weights(snr, "flow_matching", "min_snr", 5.0)


def test_weighted_mse_is_per_sample_mean_then_weighted():
    pred, target = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    target[1] *= 2  # per-sample MSE 1 and 4
    assert weighted_mse(pred, target, torch.tensor([1.0, 0.5])).item() == pytest.approx((1 + 2) / 2)


def test_noise_offset_shifts_each_channel_by_a_constant():
    noise = torch.zeros(2, 3, 4, 4)
    assert offset_noise(noise, 0.0, torch.Generator()) is noise
    shifted = offset_noise(noise, 0.1, torch.Generator().manual_seed(0))
    per_channel = shifted.flatten(2)
    assert torch.allclose(per_channel, per_channel[..., :1].expand_as(per_channel))
    assert shifted.abs().max() > 0


def test_lr_schedules_with_warmup():
    assert [lr_at(s, 1.0, "constant", 3, 10) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, 1.0, "linear", 0, 10) == pytest.approx(0.0)
    assert lr_at(4, 1.0, "linear", 0, 10) == pytest.approx(0.5)
    assert lr_at(9, 1.0, "cosine", 2, 10) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(2, 1.0, "cosine", 2, 10) == pytest.approx(0.5 * (1 + math.cos(math.pi / 8)))
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_at(0, 1.0, "exp", 0, 10)


def test_intervals_shrink_to_fit_small_steps():
    cfg = parse_config({"train": {"steps": 3, "checkpoint_every": 100, "warmup_steps": 50, "validate_every": 20}})
    t = cfg.train
    assert (t.effective_checkpoint_every(), t.effective_warmup(), t.effective_validate_every()) == (3, 0, 3)
    big = parse_config({"train": {"steps": 1000, "warmup_steps": 50, "checkpoint_every": 100}}).train
    assert (big.effective_warmup(), big.effective_checkpoint_every()) == (50, 100)
    assert big.grad_accumulation == 1


def test_ema_tracks_with_warmup_and_swaps_back():
    p = {"w": torch.zeros(3)}
    ema = EMA(p, decay=0.9)
    p["w"] += 1.0
    ema.update(p, step=0)  # decay warms up: min(0.9, 1/10) = 0.1
    assert torch.allclose(ema.shadow["w"], torch.full((3,), 0.9))
    with ema.applied(p):
        assert torch.allclose(p["w"], torch.full((3,), 0.9))
    assert torch.equal(p["w"], torch.ones(3))


def _plan(epoch: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(epoch)
    return [("a", rng.permutation(8)), ("b", rng.permutation(8) + 100), ("a", rng.permutation(8) + 8)]


def test_shards_are_disjoint_and_cover_the_global_batch():
    rows = np.arange(12)
    parts = [shard(rows, r, 4) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == rows.tolist()


def test_micro_batches_resume_from_a_position():
    full = micro_batches(_plan, 4, rank=1)
    first: list[MicroBatch] = [next(full) for _ in range(7)]
    resumed = micro_batches(_plan, 4, rank=1, start=first[3].after)
    for want in first[4:]:
        got = next(resumed)
        assert got.bucket == want.bucket and np.array_equal(got.rows, want.rows)
    assert first[2].after == Position(1, 0)  # three micro-batches per epoch
    assert np.array_equal(first[0].rows, _plan(0)[0][1][4:8])


def test_step_seed_differs_per_rank_and_micro_batch():
    seeds = {step_seed(0, r, i) for r in range(2) for i in range(50)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert step_seed(3, 1, 7) == step_seed(3, 1, 7)


def test_cpu_trains_in_float32_and_refuses_half_precision():
    from tuneline.stages.train.model import autocast_dtype, grad_scaler

    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("no", cpu) is None
    for mixed in ("bf16", "fp16"):
        with pytest.raises(ValueError, match="train.mixed_precision"):
            autocast_dtype(mixed, cpu)
    assert not grad_scaler(None).is_enabled() and not grad_scaler(torch.bfloat16).is_enabled()


def test_manifest_losses_are_downsampled_by_averaging():
    from tuneline.stages.train.worker import downsample

    assert downsample([1.0, 2.0], 500) == [1.0, 2.0]
    assert downsample([float(i) for i in range(10)], 4) == [1.0, 4.0, 7.0, 9.0]


def test_a_micro_steps_layer_seed_seeds_the_cpu_and_the_training_device_only(monkeypatch):
    """seed_layers draws as torch.manual_seed does on a CPU run, without seeding the accelerators this process never
    starts (torch.manual_seed queues that for CUDA, XPU and MTIA, capturing the stack each time: once per
    micro-step); a CUDA run seeds the CPU's generator and every GPU's, as torch.manual_seed does."""
    from tuneline.stages.train.loop import seed_layers

    torch.manual_seed(7)
    expected = torch.rand(5)
    seeded = []
    for kind in ("cuda", "xpu", "mtia"):
        monkeypatch.setattr(getattr(torch, kind), "manual_seed_all", lambda s, kind=kind: seeded.append(kind))
    seed_layers(torch.device("cpu"), 7)
    assert torch.equal(torch.rand(5), expected)
    assert seeded == []
    torch.manual_seed(7)  # what it replaces
    assert seeded
    seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeds.append)
    seed_layers(torch.device("cuda", 1), 8)  # a CUDA run: the CPU's generator and every GPU's
    drawn = torch.rand(5)
    assert seeds == [8] and torch.equal(drawn, torch.rand(5, generator=torch.Generator().manual_seed(8)))
