"""Flow-matching timestep sampling follows the configured distribution; loss weighting and sampling options fit
the family or are refused naming the fields; the prediction type comes from the model's scheduler config."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml

from tuneline.schemas.config import ConfigError, example_yaml, parse_config
from tuneline.stages.train.objective import loss_weights, noisy_and_target, prediction_type
from tuneline.stages.train.timesteps import SHARE_TOKENS, SigmaSampler, auto_shift, shift_sigmas

N = 40_000


def _draw(**kw) -> np.ndarray:
    return SigmaSampler(**kw).draw(N, torch.Generator().manual_seed(0)).double().numpy()


def _ks_uniform(x: np.ndarray) -> float:
    x = np.sort(x)
    grid = np.arange(1, len(x) + 1) / len(x)
    return float(np.max(np.abs(grid - x)))


def test_uniform_is_uniform():
    assert _ks_uniform(_draw()) < 1.36 / math.sqrt(N)  # KS at 5 %


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (-0.5, 0.7), (1.0, 1.5)])
def test_logit_normal_has_the_configured_logit_mean_and_std(mean, std):
    x = _draw(kind="logit_normal", mean=mean, std=std)
    logit = np.log(x / (1 - x))
    assert abs(logit.mean() - mean) < 0.03 and abs(logit.std() - std) < 0.03


def test_sigmoid_scale_is_the_std_of_the_logit():
    t = parse_config(
        {
            "model": {"family": "sd3"},
            "train": {"timestep_sampling": "sigmoid", "sigmoid_scale": 2.0, "loss_weighting": "none"},
        }
    ).train
    x = SigmaSampler.from_train(t).draw(N, torch.Generator().manual_seed(0)).double().numpy()
    logit = np.log(x / (1 - x))
    assert abs(logit.mean()) < 0.03 and abs(logit.std() - 2.0) < 0.03


def test_mode_sampling_matches_sd3s_quantile_function():
    s = 1.29
    x = np.sort(_draw(kind="mode", mode_scale=s))
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        u = 1 - q  # f is decreasing in u: the q-quantile of sigma is f(1 - q)
        want = 1 - u - s * (math.cos(math.pi * u / 2) ** 2 - 1 + u)
        assert abs(np.quantile(x, q) - want) < 0.01, q
    assert np.quantile(x, 0.5) == pytest.approx(0.5, abs=0.01)
    assert np.mean(np.abs(x - 0.5) < 0.2) > 0.5, "mode sampling with s > 0 puts most samples mid-schedule"


def test_shift_moves_sigmas_towards_noise_as_the_formula_says():
    sigma = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert torch.allclose(shift_sigmas(sigma, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    assert torch.equal(shift_sigmas(sigma, 1.0), sigma)
    x = SigmaSampler(shift=3.0).sample(N, torch.Generator().manual_seed(0), {}, 16).numpy()
    assert np.median(x) == pytest.approx(0.75, abs=0.01)


def test_auto_shift_is_the_models_own():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    flux = {
        "use_dynamic_shifting": True,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "base_shift": 0.5,
        "max_shift": 1.15,
    }
    for tokens in (256, 1024, 4096):
        assert auto_shift(flux, tokens) == pytest.approx(math.exp(calculate_shift(tokens)))
    assert auto_shift({"shift": 3.0}, 4096) == 3.0  # SD3
    assert auto_shift({}, 4096) == 1.0


def test_flow_target_uses_the_sampled_sigma():
    x0, noise = torch.zeros(4, 16, 4, 4), torch.ones(4, 16, 4, 4)
    sampler = SigmaSampler(kind="logit_normal", shift=2.0)
    out = noisy_and_target(x0, noise, "flow_matching", None, torch.Generator().manual_seed(3), sigmas=sampler)
    want = shift_sigmas(sampler.draw(4, torch.Generator().manual_seed(3)), 2.0)
    assert torch.allclose(out.timesteps, want * 1000)
    assert torch.allclose(out.noisy[:, 0, 0, 0], want)  # (1 - sigma) * 0 + sigma * 1


def test_auto_loss_weighting_fits_the_prediction_type():
    snr = torch.tensor([0.5, 5.0, 50.0])
    assert torch.allclose(loss_weights(snr, "epsilon", "auto", 5.0), loss_weights(snr, "epsilon", "min_snr", 5.0))
    assert torch.equal(loss_weights(snr, "flow_matching", "auto", 5.0), torch.ones(3))


def _example(**edits) -> dict:
    cfg = yaml.safe_load(example_yaml())
    for dotted, value in edits.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    return cfg


def test_example_is_auto_and_stays_valid_for_every_family():
    assert yaml.safe_load(example_yaml())["train"]["loss_weighting"] == "auto"
    for family in ("tiny", "sd15", "sdxl", "sd3", "flux"):
        parse_config(_example(**{"model.family": family}), resolve=False)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_min_snr_on_a_flow_family_is_refused_naming_both_fields(family):
    with pytest.raises(ConfigError) as err:
        parse_config(_example(**{"model.family": family, "train.loss_weighting": "min_snr"}), resolve=False)
    assert "train.loss_weighting" in str(err.value) and "model.family" in str(err.value)


def test_flow_options_on_an_epsilon_family_are_refused():
    with pytest.raises(ConfigError) as err:
        parse_config(
            _example(**{"train.timestep_sampling": "logit_normal", "train.timestep_shift": 3.0}), resolve=False
        )
    assert "train.timestep_sampling" in str(err.value) and "train.timestep_shift" in str(err.value)


def test_prediction_type_comes_from_the_scheduler_config(tmp_path):
    """A tiny flavor whose scheduler says v_prediction trains on the velocity target, and its denoiser identity
    changes with that config (so a cache or a trained result built for epsilon is stale)."""
    import json
    import shutil

    from tuneline.stages.families import folders
    from tuneline.stages.families.registry import get_family

    fam = get_family("tiny")
    base = fam.ensure_model(None, tmp_path / "models")
    vpred = tmp_path / "vpred"
    shutil.copytree(base, vpred)
    conf = vpred / "scheduler" / "scheduler_config.json"
    conf.write_text(json.dumps(json.loads(conf.read_text()) | {"prediction_type": "v_prediction"}))
    sched = fam.load_noise_scheduler(vpred)
    assert prediction_type(fam.facts.prediction, fam.load_noise_scheduler(base)) == "epsilon"
    assert prediction_type(fam.facts.prediction, sched) == "v_prediction"
    assert prediction_type(fam.facts.prediction, sched, "epsilon") == "epsilon"  # model.prediction_type wins
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    out = noisy_and_target(
        x0, noise, prediction_type(fam.facts.prediction, sched), sched, torch.Generator().manual_seed(0)
    )
    assert torch.allclose(out.target, sched.get_velocity(x0, noise, out.timesteps))
    assert folders.identity(fam.facts, vpred, "denoiser") != folders.identity(fam.facts, base, "denoiser")
    assert folders.identity(fam.facts, vpred, "vae") == folders.identity(fam.facts, base, "vae")


def test_each_step_draws_in_one_experts_share_and_the_steps_keep_the_samplers_distribution():
    """A run of two timestep experts (boundary 0.875, as the A14B's): every step's sigmas fall in one share, the
    same for a (seed, step) wherever it is drawn (every rank; a resumed run); the shares get the steps their mass
    under the sampler gives them, and within a share the sigmas follow the sampler there, so over the steps the
    sigmas are distributed as one sampler's over the whole schedule."""
    sampler = SigmaSampler(kind="logit_normal", shift=3.0, splits=(0.875,))
    whole = SigmaSampler(kind="logit_normal", shift=3.0).sample(N, torch.Generator().manual_seed(1), {}, 16).numpy()
    steps = 4000
    shares = [sampler.step_share(7, step, {}) for step in range(steps)]
    assert shares == [sampler.step_share(7, step, {}) for step in range(steps)]
    assert set(shares) == {(0.0, 0.875), (0.875, 1.0 + 1e-9)}
    high = sum(s[0] == 0.875 for s in shares) / steps
    assert high == pytest.approx(float(np.mean(whole >= 0.875)), abs=0.025)
    gen = torch.Generator().manual_seed(2)
    drawn = np.concatenate([sampler.sample(4, gen, {}, 16, within=s).numpy() for s in shares])
    assert all(lo <= x < hi for (lo, hi), xs in zip(shares, drawn.reshape(steps, 4)) for x in xs)
    assert np.quantile(drawn, [0.1, 0.5, 0.9]) == pytest.approx(np.quantile(whole, [0.1, 0.5, 0.9]), abs=0.02)


def test_a_steps_expert_does_not_depend_on_the_micro_batchs_token_count():
    """With a resolution-dependent shift (Flux's dynamic shifting) two ranks' micro-batches of different sizes
    (buckets, clip lengths) draw different sigmas, yet a step's expert share comes from (seed, step) and SHARE_TOKENS
    only, so every rank and micro-step of the step runs the same expert."""
    dynamic = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}
    sampler = SigmaSampler(kind="logit_normal", splits=(0.5,))
    edges = ((0.0, 0.5), (0.5, 1.0 + 1e-9))

    def side(step: int, tokens: int) -> tuple[float, float]:  # the share a draw for `tokens` tokens would pick
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([3, step, 2]).generate_state(1)[0]))
        sigma = float(sampler.sample(1, gen, dynamic, tokens))
        return next(e for e in edges if e[0] <= sigma < e[1])

    steps = range(200)
    small, large = [side(s, 256) for s in steps], [side(s, 16384) for s in steps]
    assert small != large  # the token count moves the draw across the boundary on some steps
    shares = [sampler.step_share(3, s, dynamic) for s in steps]
    assert shares == [side(s, SHARE_TOKENS) for s in steps]
    assert set(shares) == set(edges)
