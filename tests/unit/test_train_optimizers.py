"""train.optimizer: every choice resumes exactly through a checkpoint; schedule-free's eval weights; refusals."""

import pytest
import torch

from tests.unit.optimizer_runs import fresh, init_and_grads, run_steps, straight_and_cut
from tuneline.schemas.train import TrainConfig
from tuneline.stages.train import checkpoint as ckpt
from tuneline.stages.train.optimizers import build_optimizer, eval_weights, restore_state, state_tensors

SETTINGS = {
    "adamw": {"learning_rate": 1e-2},
    "prodigy": {"learning_rate": 1.0},
    "adafactor": {"learning_rate": 1e-2},
    "adamw_schedulefree": {"learning_rate": 1e-2},
    "lion": {"learning_rate": 1e-3},
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_optimizer_resumes_exactly(name, tmp_path):
    """Four steps straight equal two steps, a checkpoint through safetensors + JSON, a new optimizer, two
    steps; the state changed the weights (the run is not a no-op)."""
    t = TrainConfig(optimizer=name, weight_decay=0.01, **SETTINGS[name])
    init, grads = init_and_grads()
    straight, first, opt = straight_and_cut(init, grads, t)
    names = list(first)
    tensors, meta = state_tensors(opt, names)
    path = ckpt.save(tmp_path, 2, {"optimizer": tensors, "trainable": dict(first)}, {"optimizer": meta})
    state, loaded = ckpt.load(path)
    resumed = {k: torch.nn.Parameter(loaded["trainable"][k].clone()) for k in names}  # the model's order
    opt2 = build_optimizer(list(resumed.values()), t)
    restore_state(opt2, names, loaded["optimizer"], state["optimizer"])
    run_steps(resumed, opt2, grads[2:])
    for k in init:
        torch.testing.assert_close(resumed[k].detach(), straight[k].detach(), rtol=0, atol=0)
        assert not torch.equal(straight[k].detach(), init[k])


def test_schedule_free_eval_weights_and_exact_return():
    """Inside eval_weights the parameters are schedule-free's averaged x (not the training y); after it the
    exact training weights come back, so validating mid-run changes nothing that follows."""
    t = TrainConfig(optimizer="adamw_schedulefree", learning_rate=1e-2)
    init, grads = init_and_grads()
    plain, checked, opt = straight_and_cut(init, grads, t)
    y = {k: p.detach().clone() for k, p in checked.items()}
    with eval_weights(opt, checked):
        x = {k: p.detach().clone() for k, p in checked.items()}
        z = {k: opt.state[p]["z"] for k, p in checked.items()}
        beta1 = opt.param_groups[0]["betas"][0]
        for k in init:  # y = (1 - beta1) z + beta1 x  (the method's interpolation)
            torch.testing.assert_close(y[k], (1 - beta1) * z[k] + beta1 * x[k])
            assert not torch.equal(x[k], y[k])
    for k in init:
        assert torch.equal(checked[k].detach(), y[k])
    run_steps(checked, opt, grads[2:])
    for k in init:
        assert torch.equal(checked[k].detach(), plain[k].detach())


def test_adamw_kernel_is_the_running_process_choice_not_the_checkpoints():
    """A checkpoint written by a foreach AdamW resumes on the fused kernel AdamW runs on one device (adamw_kernel), as a
    fresh run does; its moments and step count come back as saved, and the run goes on as the foreach one would
    (within fused's rounding)."""
    t = TrainConfig(learning_rate=1e-2)
    init, grads = init_and_grads()

    def foreach_adamw(params):
        return torch.optim.AdamW(list(params.values()), lr=t.learning_rate, weight_decay=t.weight_decay, foreach=True)

    straight = fresh(init)
    run_steps(straight, foreach_adamw(straight), grads)
    elsewhere = fresh(init)
    foreach = foreach_adamw(elsewhere)
    run_steps(elsewhere, foreach, grads[:2])
    names = list(elsewhere)
    tensors, meta = state_tensors(foreach, names)
    resumed = fresh({k: p.detach() for k, p in elsewhere.items()})  # the checkpoint's weights
    opt = build_optimizer(list(resumed.values()), t)
    assert (opt.param_groups[0]["foreach"], opt.param_groups[0]["fused"]) == (None, True)
    restore_state(opt, names, {k: v.clone() for k, v in tensors.items()}, meta)  # as read back from the file
    assert (opt.param_groups[0]["foreach"], opt.param_groups[0]["fused"]) == (None, True)
    for k, p in resumed.items():
        assert torch.equal(opt.state[p]["exp_avg"], foreach.state[elsewhere[k]]["exp_avg"])
        assert float(opt.state[p]["step"]) == 2.0
    run_steps(resumed, opt, grads[2:])
    for k in init:
        torch.testing.assert_close(resumed[k].detach(), straight[k].detach())
        assert not torch.equal(resumed[k].detach(), elsewhere[k].detach())


def test_adamw_is_fused_on_one_device_and_foreach_under_block_swap():
    """Block swap keeps the swapped blocks' parameters on the CPU beside the GPU's. The grad scaler then hands fused
    AdamW the sum of the devices' overflow flags, and fused skips a step only when it is exactly 1 (torch's
    behaviour, pinned below), so those runs step with foreach, whose skip the scaler decides on any non-zero sum."""
    init, grads = init_and_grads(1)
    params = fresh(init)
    plain = build_optimizer(list(params.values()), TrainConfig())
    assert (plain.param_groups[0]["foreach"], plain.param_groups[0]["fused"]) == (None, True)
    swapped = build_optimizer(list(params.values()), TrainConfig(blocks_to_swap=2, processes=1))
    assert (swapped.param_groups[0]["foreach"], swapped.param_groups[0]["fused"]) == (True, None)
    for flags, skipped in ((1.0, True), (2.0, False)):  # one device's overflow; both devices'
        p = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        p.grad = torch.full((4,), float("inf"))
        opt.grad_scale, opt.found_inf = None, torch.tensor(flags)
        opt.step()
        assert torch.equal(p.detach(), torch.ones(4)) == skipped, (flags, p)


def test_eval_weights_leaves_other_optimizers_alone():
    init, grads = init_and_grads(1)
    params = fresh(init)
    opt = build_optimizer(list(params.values()), TrainConfig(optimizer="lion", learning_rate=1e-3))
    run_steps(params, opt, grads)
    before = {k: p.detach().clone() for k, p in params.items()}
    with eval_weights(opt, params, restore=False):
        assert all(torch.equal(params[k].detach(), before[k]) for k in init)


@pytest.mark.parametrize(
    "settings, fields",
    [
        ({"optimizer": "prodigy", "learning_rate": 1e-4}, "train.learning_rate.*train.optimizer prodigy"),
        ({"optimizer": "adamw_schedulefree", "lr_schedule": "cosine"}, "train.lr_schedule.*adamw_schedulefree"),
        ({"optimizer": "adamw_schedulefree", "ema": True}, "train.ema.*adamw_schedulefree"),
        ({"optimizer": "adafactor", "optimizer_betas": [0.9, 0.99]}, "train.optimizer_betas.*adafactor"),
        ({"optimizer": "lion", "optimizer_betas": [0.9, 1.5]}, "train.optimizer_betas"),
        ({"optimizer": "adamw", "prodigy_d_coef": 0.5}, "train.prodigy_d_coef.*prodigy"),
    ],
)
def test_optimizer_settings_refused_at_load_naming_fields(settings, fields):
    with pytest.raises(ValueError, match=fields):
        TrainConfig(**settings)


def test_optimizer_settings_accepted():
    TrainConfig(optimizer="prodigy", learning_rate=1.0, prodigy_d_coef=0.5)
    TrainConfig(optimizer="adamw_schedulefree", warmup_steps=10)
    TrainConfig(optimizer="lion", optimizer_betas=[0.95, 0.98], learning_rate=1e-4)
