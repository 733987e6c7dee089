"""Memory options of the train stage on CPU: block swap, offloaded checkpointing, 8-bit AdamW, same numbers."""

import pytest
import torch

from tests.unit.optimizer_runs import run_steps, straight_and_cut
from tuneline.schemas.train import TrainConfig
from tuneline.stages.families.registry import get_family
from tuneline.stages.train import checkpoint as ckpt
from tuneline.stages.train.model import prepare_denoiser
from tuneline.stages.train.optimizers import build_optimizer, restore_state, state_tensors
from tuneline.stages.train.swap import BlockSwapper, transformer_blocks

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    return {
        name: (get_family(name), get_family(name).ensure_model(None, cache)) for name in ("sd15", "flux", "z_image")
    }


def batches(fam, model_dir, steps):
    enc = fam.load_text_encoders(model_dir, torch.float32, CPU)
    g = torch.Generator().manual_seed(0)
    from tuneline.stages.families.base import MicroCond

    for _ in range(steps):
        x = torch.randn(2, fam.facts.latent_channels, 16, 16, generator=g)
        ts = torch.randint(0, 1000, (2,), generator=g).float()
        yield (
            x,
            ts,
            fam.encode_text(enc, ["a red square", "a blue circle"]),
            [MicroCond((128, 128), (0, 0), (128, 128))] * 2,
        )


def train(fam, model_dir, steps=2, swap=0, quantize=None, **train):
    """Losses, last gradients, final weights and the most blocks resident when any block started (counted
    from the weights' storage, independently of the swapper's own bookkeeping)."""
    t = TrainConfig(processes=1, **train)
    den, params = prepare_denoiser(fam, model_dir, t, torch.float32, CPU, quantize)
    stacks = fam.block_stacks(den)
    swapper = BlockSwapper(den, stacks, swap, CPU, t.mode == "full") if swap else None
    blocks, resident = transformer_blocks(den, stacks), []

    def count(module, args):
        resident.append(
            sum(
                all(p.untyped_storage().nbytes() > 0 for p in b.parameters() if t.mode == "full" or not p.requires_grad)
                for b in blocks
            )
        )

    for b in blocks:
        b.register_forward_pre_hook(count)
    opt = build_optimizer(list(params.values()), t)
    losses = []
    for x, ts, text, micro in batches(fam, model_dir, steps):
        loss = (fam.denoise(den, x, ts, text, micro=micro).float() ** 2).mean()
        loss.backward()
        if swapper is not None and swapper.full:
            swapper.home()
        grads = {k: p.grad.clone() for k, p in params.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    weights = {k: p.detach().clone() for k, p in params.items()}
    return losses, grads, weights, max(resident), len(blocks)


def assert_same(a, b):
    assert a[0] == b[0]
    for k in a[1]:
        torch.testing.assert_close(a[1][k], b[1][k], rtol=0, atol=0)
        torch.testing.assert_close(a[2][k], b[2][k], rtol=0, atol=0)


@pytest.mark.parametrize(
    "name,mode,swap,checkpointing,quantize",
    [
        ("sd15", "lora", 3, True, None),
        ("sd15", "full", 2, False, None),
        ("flux", "lora", 1, False, None),
        ("flux", "full", 1, True, None),
        ("z_image", "lora", 1, True, None),
        ("sd15", "lora", 3, True, "int8"),
    ],
)
def test_block_swap_same_numbers_and_at_most_blocks_minus_n_resident(models, name, mode, swap, checkpointing, quantize):
    fam, model_dir = models[name]
    plain = train(fam, model_dir, mode=mode, gradient_checkpointing=checkpointing, quantize=quantize)
    swapped = train(fam, model_dir, swap=swap, mode=mode, gradient_checkpointing=checkpointing, quantize=quantize)
    assert_same(plain, swapped)
    blocks = swapped[4]
    assert plain[3] == blocks
    assert swapped[3] <= blocks - swap


def test_a_block_touched_while_swapped_out_fails(models):
    fam, model_dir = models["sd15"]
    den, _ = prepare_denoiser(fam, model_dir, TrainConfig(mode="lora", processes=1), torch.float32, CPU)
    stacks = fam.block_stacks(den)
    swapper = BlockSwapper(den, stacks, 2, CPU, full=False)
    last = transformer_blocks(den, stacks)[-1]
    with pytest.raises(RuntimeError):  # a released weight is an empty placeholder: any use fails
        last.attn1.to_q.base_layer(torch.zeros(1, last.attn1.to_q.in_features))
    swapper.start_step = lambda: None  # a wrong schedule: blocks never brought back in
    x, ts, text, micro = next(batches(fam, model_dir, 1))
    fam.denoise(den, x, ts, text, micro=micro)  # first forward: the blocks were released at install
    with pytest.raises(RuntimeError, match="swapped out"):
        fam.denoise(den, x, ts, text, micro=micro)


def test_too_many_blocks_refused_naming_the_field(models):
    fam, model_dir = models["flux"]
    den, _ = prepare_denoiser(fam, model_dir, TrainConfig(mode="lora", processes=1), torch.float32, CPU)
    with pytest.raises(ValueError, match="train.blocks_to_swap 5.*at most 1"):
        BlockSwapper(den, fam.block_stacks(den), 5, CPU, full=False)


def test_offloaded_checkpointing_same_numbers_as_checkpointing(models):
    fam, model_dir = models["sd15"]
    assert_same(
        train(fam, model_dir, mode="lora", gradient_checkpointing=True),
        train(fam, model_dir, mode="lora", gradient_checkpointing="offload"),
    )


def test_full_fine_tune_swap_refused_with_ddp_naming_both_fields():
    with pytest.raises(ValueError, match="train.blocks_to_swap.*train.processes"):
        TrainConfig(mode="full", blocks_to_swap=2, processes=2)
    TrainConfig(mode="lora", blocks_to_swap=2, processes=2)
    TrainConfig(mode="full", blocks_to_swap=2, processes=1)
    with pytest.raises(ValueError):
        TrainConfig(gradient_checkpointing="cpu")
    with pytest.raises(ValueError):
        TrainConfig(optimizer="sgd")


def test_adamw8bit_resumes_exactly(tmp_path):
    """Three steps straight equal two steps, a checkpoint through safetensors, a new optimizer, one step."""
    torch.manual_seed(0)
    init = {"w": torch.randn(64, 128), "b": torch.randn(128)}  # w is large enough for 8-bit state
    grads = [{k: torch.randn_like(v) for k, v in init.items()} for _ in range(3)]
    t = TrainConfig(optimizer="adamw8bit", learning_rate=1e-2, weight_decay=0.01)
    straight, first, opt = straight_and_cut(init, grads, t)
    names = list(first)
    tensors, meta = state_tensors(opt, names)
    assert any(k.endswith(".codes") and v.dtype == torch.uint8 for k, v in tensors.items())
    path = ckpt.save(tmp_path, 2, {"optimizer": tensors}, {"optimizer": meta})
    state, loaded = ckpt.load(path)
    resumed = {k: torch.nn.Parameter(v.detach().clone()) for k, v in first.items()}
    opt2 = build_optimizer(list(resumed.values()), t)
    restore_state(opt2, names, loaded["optimizer"], state["optimizer"])
    run_steps(resumed, opt2, grads[2:])
    for k in init:
        torch.testing.assert_close(resumed[k].detach(), straight[k].detach(), rtol=0, atol=0)
    assert not torch.equal(straight["w"].detach(), init["w"])


def saved_bytes(fam, den, batch, edge, controls: int = 0, dtype: torch.dtype = torch.float32):
    """Bytes of the distinct tensors autograd saves for backward in one real forward on the CPU (weights
    excluded: the plan counts them as weights), with `controls` control images per sample, inputs in `dtype`."""
    from tuneline.stages.families.base import MicroCond
    from tuneline.stages.train.memtrace import control_input, text_inputs

    weights = {p.untyped_storage().data_ptr() for p in den.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    f = fam.facts
    x = torch.randn(batch, f.latent_channels, edge // f.vae_factor, edge // f.vae_factor, dtype=dtype)
    ts = torch.full((batch,), 500.0) if f.prediction == "flow_matching" else torch.full((batch,), 500)
    text = {k: torch.randn(v.shape, dtype=dtype) for k, v in text_inputs(fam, den, batch).items()}
    if controls:
        text["control_latents"] = torch.randn(control_input(fam, batch, edge, controls, torch.float32).shape)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fam.denoise(den, x, ts, text, micro=[MicroCond((edge, edge), (0, 0), (edge, edge))] * batch)
    return sum(seen.values())


def mid_size_unet(tmp_path, models):
    """An SD1.5-layout UNet of ~40M parameters (the tiny one has ~0.1M)."""
    import json
    import shutil

    fam, tiny = models["sd15"]
    folder = tmp_path / "mid"
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "unet" / "config.json").read_text())
    cfg.update(
        block_out_channels=[256, 512],
        layers_per_block=1,
        attention_head_dim=8,
        cross_attention_dim=cfg["cross_attention_dim"],
        norm_num_groups=32,
    )
    (folder / "unet" / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("size,mode", [("tiny", "full"), ("mid", "lora")])
def test_planned_activations_match_the_tensors_saved_for_backward(models, tmp_path, size, mode):
    """The plan traces the forward on the meta device; a real CPU forward of the same model saves the same
    tensors. Tolerance: never more than 5 % under (an under-planned run is the one that runs out of memory),
    at most 10 % over. The trace sees every saved tensor by its storage, as the real count does; what differs
    is the attention kernel, modelled as a fused one keeping q, k, v, its output and a float32 log-sum-exp,
    where the CPU's flash kernel keeps slightly less (the mid-size model plans 5.6 % over)."""
    from tuneline.stages.train.memtrace import trace_activations
    from tuneline.stages.train.planfacts import build_meta

    fam, model_dir = models["sd15"]
    if size == "mid":
        model_dir = mid_size_unet(tmp_path, models)
    t = TrainConfig(mode=mode, processes=1)
    meta = build_meta(fam, model_dir, t, torch.float32, None)
    planned = trace_activations(fam, meta, 2, 128, torch.float32)
    cls = type(meta)
    torch.manual_seed(0)
    real = cls.from_config(cls.load_config(model_dir, subfolder="unet"))
    if mode == "lora":
        from tuneline.stages.train.model import lora_config

        real.requires_grad_(False)
        real.add_adapter(lora_config(t, fam, real))
    measured = saved_bytes(fam, real, 2, 128)
    total = planned.outside + sum(planned.blocks)
    assert sum(p.numel() for p in real.parameters()) > (3e7 if size == "mid" else 0)
    assert -0.05 * measured <= total - measured <= 0.10 * measured, (total, measured)


@pytest.mark.parametrize("name", ["flux", "qwen_image", "flux2_klein"])
def test_planned_activations_under_autocast_match_a_half_base_step(tmp_path_factory, name):
    """A LoRA over a bf16 base trains under autocast with the lean norms and LoRA inputs (stages/train/lean.py):
    the plan traces the forward with autocast's casts, and a real CPU forward of the denoiser as training
    prepares it, under bf16 autocast, saves the same within the tolerance above."""
    from tuneline.stages.train.memtrace import trace_activations
    from tuneline.stages.train.planfacts import build_meta

    fam = get_family(name)
    model_dir = fam.ensure_model(None, tmp_path_factory.mktemp(f"{name}-models"))
    t = TrainConfig(mode="lora", processes=1)
    meta = build_meta(fam, model_dir, t, torch.bfloat16, None)
    planned = trace_activations(fam, meta, 2, 64, torch.bfloat16, amp=torch.bfloat16)
    real, _ = prepare_denoiser(fam, model_dir, t, torch.bfloat16, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = saved_bytes(fam, real, 2, 64, dtype=torch.bfloat16)
    total = planned.outside + sum(planned.blocks)
    assert -0.05 * measured <= total - measured <= 0.10 * measured, (total, measured)


@pytest.mark.parametrize("name", ["qwen_image_edit", "flux_kontext"])
def test_a_paired_dataset_plans_the_control_tokens(tmp_path_factory, name):
    """An edit family trained on pairs feeds each sample's control tokens beside the target's (Qwen-Image-Edit's
    cached at about 1 MP whatever the bucket): a paired config's plan traces them and matches a real forward with
    its control latents (the 64-pixel target alone saves a quarter of that for Qwen-Image-Edit)."""
    from tuneline.schemas.config import parse_config
    from tuneline.stages.train.memplan import planned_controls
    from tuneline.stages.train.memtrace import trace_activations
    from tuneline.stages.train.model import freeze_unused
    from tuneline.stages.train.planfacts import build_meta

    fam = get_family(name)
    model_dir = fam.ensure_model(None, tmp_path_factory.mktemp("edit-models"))
    paired = parse_config({"model": {"family": name}, "dataset": {"control": "inputs"}})
    assert planned_controls(paired, fam) == 1
    assert planned_controls(parse_config({"model": {"family": name}}), fam) == 0
    assert planned_controls(parse_config({"dataset": {"control": "inputs"}}), get_family("tiny")) == 0
    t = TrainConfig(mode="full", processes=1)
    meta = build_meta(fam, model_dir, t, torch.float32, None)
    planned = trace_activations(fam, meta, 2, 64, torch.float32, controls=1)
    cls = type(meta)
    torch.manual_seed(0)
    real = cls.from_config(cls.load_config(model_dir, subfolder=fam.denoiser_component))
    freeze_unused(fam, real, fam.denoiser_component)  # as a full fine-tune trains it (Family.unused_modules)
    measured, alone = saved_bytes(fam, real, 2, 64, controls=1), saved_bytes(fam, real, 2, 64)
    total = planned.outside + sum(planned.blocks)
    assert measured > alone * (3 if name == "qwen_image_edit" else 1)
    assert -0.05 * measured <= total - measured <= 0.10 * measured, (total, measured)
