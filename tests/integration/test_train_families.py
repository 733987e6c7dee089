"""The training loop on every other family's tiny flavor, in-process (tests/trainer.py): LoRA on SDXL (micro-conditioning), SD3 and
Flux (flow matching, transformer LoRA), saved as `final/` LoRA weights that stock diffusers' load_lora_weights
takes, and a checkpoint that restores the exact state."""

from __future__ import annotations

import pytest
import torch

from tests.integration.family_runs import render_latents
from tests.integration.test_train_support import small_config
from tests.trainer import steps, trainer_for
from tuneline.stages.families import resolve as models
from tuneline.stages.train import checkpoint as ckpt
from tuneline.stages.train.model import save_final

CPU = torch.device("cpu")
TRAIN = {
    "mode": "lora",
    "lora_rank": 4,
    "batch_size": 2,
    "processes": 1,
    "steps": 2,
    "learning_rate": 1e-2,
    "loss_weighting": "auto",
    "latent_sampling": "sample",
}


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_lora_trains_saves_and_loads_in_stock_diffusers(family, tmp_path, upstream_store, demo_data):
    from diffusers import DiffusionPipeline

    cfg = small_config(tmp_path, TRAIN, model={"family": family, "device": "cpu"}, dataset={"path": str(demo_data)})
    ctx = upstream_store.upstream(cfg)
    trainer = trainer_for(cfg, ctx)
    steps(trainer, 1)
    saved = ckpt.save(tmp_path / "ckpt", trainer.step, *trainer.checkpoint())
    steps(trainer, 1)
    assert all(torch.isfinite(torch.tensor(trainer.losses)))

    again = trainer_for(cfg, ctx)  # restored at step 1, then the same second step: the same adapter weights
    again.restore(saved)
    steps(again, 1)
    for name, p in trainer.params.items():
        torch.testing.assert_close(again.params[name], p, msg=name)

    save_final(trainer.fam, models.model_dir(ctx), trainer.denoiser, cfg.train, tmp_path / "final")
    pipe = DiffusionPipeline.from_pretrained(models.model_dir(ctx))
    pipe.set_progress_bar_config(disable=True)
    before = render_latents(pipe)
    pipe.load_lora_weights(tmp_path / "final")
    assert not torch.allclose(render_latents(pipe), before), "the LoRA weights did not reach the denoiser"
    image = pipe("a red square", num_inference_steps=2, height=64, width=64).images[0]
    assert image.size == (64, 64)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_flow_families_train_with_every_timestep_sampler(family, tmp_path, upstream_store, demo_data):
    """One step per sampler on the real tiny transformer: finite losses, and the sampler changes the sigmas drawn
    (hence the loss) from the same seed."""
    cfg = small_config(tmp_path, TRAIN, model={"family": family, "device": "cpu"}, dataset={"path": str(demo_data)})
    ctx = upstream_store.upstream(cfg)
    losses = {}
    for sampling, shift in [
        ("uniform", 1.0),
        ("uniform", "auto"),
        ("logit_normal", "auto"),
        ("sigmoid", 3.0),
        ("mode", "auto"),
    ]:
        run = small_config(
            tmp_path,
            {**TRAIN, "timestep_sampling": sampling, "timestep_shift": shift, "sigmoid_scale": 2.0},
            model={"family": family, "device": "cpu"},
            dataset={"path": str(demo_data)},
        )
        trainer = trainer_for(run, ctx)
        steps(trainer, 1)
        losses[(sampling, shift)] = trainer.losses[0]
    assert all(torch.isfinite(torch.tensor(list(losses.values())))), losses
    assert len({round(v, 6) for v in losses.values()}) == len(losses), f"samplers did not change the draw: {losses}"


def test_int8_frozen_base_trains_a_lora_close_to_the_float_run(tmp_path, upstream_store, demo_data):
    """model.quantize int8: the tiny denoiser's linear layers hold int8 weights, the LoRA trains on top, and the
    losses stay within a few percent of the same run on the float base."""
    train = {**TRAIN, "steps": 3}
    cfg = small_config(tmp_path, train, model={"device": "cpu"}, dataset={"path": str(demo_data)})
    ctx = upstream_store.upstream(cfg)
    plain = trainer_for(cfg, ctx)
    steps(plain, 3)
    quant_cfg = small_config(
        tmp_path, train, model={"device": "cpu", "quantize": "int8"}, dataset={"path": str(demo_data)}
    )
    quant = trainer_for(quant_cfg, ctx)
    # int8 covers linear layers; the tiny family's LoRA also wraps convolutions, which stay float
    wrapped = [m for m in quant.denoiser.modules() if isinstance(getattr(m, "base_layer", None), torch.nn.Linear)]
    assert wrapped and all("Int8" in type(m.base_layer.weight).__name__ for m in wrapped), {
        type(m.base_layer.weight).__name__ for m in wrapped
    }
    steps(quant, 3)
    assert all(n.startswith("lora") or "lora_" in n for n in quant.params), "only the LoRA trains"
    torch.testing.assert_close(torch.tensor(quant.losses), torch.tensor(plain.losses), rtol=0.05, atol=1e-3)


def test_latents_sampled_in_the_feed_are_the_ones_the_step_would_draw(tmp_path, monkeypatch, upstream_store, demo_data):
    """On a CPU training device the feed's threads draw mean + std * eps; the step then draws the diffusion noise from
    the same generator. Drawing everything in the step instead (as on a GPU) must give the same losses and weights."""
    from tuneline.stages.train import loop

    cfg = small_config(tmp_path, TRAIN, model={"family": "sdxl", "device": "cpu"}, dataset={"path": str(demo_data)})
    ctx = upstream_store.upstream(cfg)
    in_feed = trainer_for(cfg, ctx)
    steps(in_feed, 2)
    monkeypatch.setattr(loop, "samples_in_feed", lambda device: False)
    in_step = trainer_for(cfg, ctx)
    steps(in_step, 2)
    assert in_feed.losses == in_step.losses and len(in_feed.losses) == 2
    for name, p in in_feed.params.items():
        assert torch.equal(in_step.params[name], p), name
