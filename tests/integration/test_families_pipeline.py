"""Every family's tiny flavor end to end through real diffusers/transformers classes: build, load the way users
load, encode, denoise, save, render. Each tiny model is built once per session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.family_runs import tiny_models
from tuneline.stages.families.registry import family_names, get_family

FAMILIES = family_names()
# The shared parity checks below (facts read back from the folder, encode_prompt parity, rendering through the saved
# folder with a negative) cover every family; _pipeline_encode calls each pipeline's encode_prompt its own way.
# flux_kontext renders at max_area (its pipeline's own size otherwise): checked in test_edit_family.py.
# The Qwen-Image-Edit pipelines need an input image: checked in test_qwen_edit_family.py and
# test_qwen_edit_plus_family.py.
PARITY = [n for n in FAMILIES if n not in ("flux_kontext", "qwen_image_edit", "qwen_image_edit_plus")]
CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family-models")


@pytest.fixture(scope="session")
def built(cache_dir):
    """family name → its tiny model folder, built on first use and shared by every test."""
    return tiny_models(cache_dir)


@pytest.fixture(scope="session")
def encoders(built):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = get_family(name).load_text_encoders(built(name), torch.float32, CPU)
        return cache[name]

    return get


def _pipe(folder: Path):
    from diffusers import DiffusionPipeline

    extra = {}
    if (folder / "processor").is_dir():  # Qwen-Image-Edit's Qwen2-VL processor, loadable without torchvision
        from tuneline.stages.families.qwen_image_edit.vocab import load_processor

        extra["processor"] = load_processor(folder / "processor")
    pipe = DiffusionPipeline.from_pretrained(folder, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_build_is_deterministic_and_reused(name, built, tmp_path):
    fam = get_family(name)
    first = built(name)
    stamp = (first / "model_index.json").stat().st_mtime_ns
    assert fam.ensure_model(None, first.parent) == first
    assert (first / "model_index.json").stat().st_mtime_ns == stamp, "a complete folder must be reused, not rebuilt"
    second = fam.ensure_model(None, tmp_path)
    for comp in ("vae", "text", "denoiser"):
        assert fam.identity(first, comp) == fam.identity(second, comp), comp
    assert len({fam.identity(first, c) for c in ("vae", "text", "denoiser")}) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp build folder left behind"


@pytest.mark.parametrize("name", PARITY)
def test_folder_matches_facts(name, built):
    """The static facts configs are checked against are what the model folder really does."""
    fam = get_family(name)
    pipe = fam.load_pipeline(built(name), torch.float32, CPU)
    assert type(pipe).__name__ == fam.pipeline_class.__name__
    facts = fam.facts
    # a video pipeline names its spatial factor apart from its temporal one
    assert (getattr(pipe, "vae_scale_factor_spatial", None) or pipe.vae_scale_factor) == facts.vae_factor
    vae_cfg = pipe.vae.config
    assert getattr(vae_cfg, "latent_channels", None) or vae_cfg.z_dim == facts.latent_channels
    stats = fam.latent_stats(pipe.vae)
    if stats is not None:  # per-channel normalisation: as many statistics as latent channels
        assert [len(s) for s in stats] == [facts.latent_channels] * 2
    assert fam.vae_factors(pipe.vae) == pytest.approx((facts.scaling_factor, facts.shift_factor))
    denoiser = getattr(pipe, fam.denoiser_component)
    # Flux and Qwen-Image pack 2x2 outside the transformer (4x the latent channels in); the others patch inside.
    packed = denoiser.config.in_channels // facts.latent_channels
    # Z-Image's transformer lists its patch sizes (all_patch_size); Wan's is (time, height, width); the others one.
    c = denoiser.config
    patch = 2 if packed == 4 else getattr(c, "patch_size", None) or getattr(c, "all_patch_size", [1])[0]
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch
    assert patch == facts.patch_size
    sched = fam.load_noise_scheduler(built(name))
    kind = "flow_matching" if "FlowMatch" in type(sched).__name__ else sched.config.prediction_type
    assert kind == facts.prediction


def _pipeline_encode(pipe, prompts: list[str], length: int) -> dict[str, torch.Tensor]:
    """The pipeline's own prompt encoding, as named tensors, for parity with the adapter."""
    cls = type(pipe).__name__
    if cls == "StableDiffusionPipeline":
        pe, _ = pipe.encode_prompt(prompts, CPU, 1, False)
        return {"prompt_embeds": pe}
    if cls == "QwenImagePipeline":  # padded to the longest prompt: our fixed length is compared up to it
        pe, mask = pipe.encode_prompt(prompts, device=CPU, max_sequence_length=length)
        return {"prompt_embeds": pe, "prompt_embeds_mask": mask}
    if cls == "ZImagePipeline":  # one variable-length tensor per prompt: ours padded with a mask, compared trimmed
        pe, _ = pipe.encode_prompt(prompts, device=CPU, do_classifier_free_guidance=False, max_sequence_length=length)
        return {"prompt_embeds": pe}
    if cls == "WanPipeline":  # the real tokens' states, zeros after them up to max_sequence_length, as ours
        pe, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=length, device=CPU)
        return {"prompt_embeds": pe}
    if cls in ("Flux2Pipeline", "Flux2KleinPipeline"):  # padded to max_sequence_length, as ours
        pe, _ = pipe.encode_prompt(prompts, device=CPU, max_sequence_length=length)
        return {"prompt_embeds": pe}
    if cls == "StableDiffusionXLPipeline":
        pe, _, pooled, _ = pipe.encode_prompt(prompts, device=CPU, do_classifier_free_guidance=False)
    elif cls == "StableDiffusion3Pipeline":
        pe, _, pooled, _ = pipe.encode_prompt(
            prompts, None, None, device=CPU, do_classifier_free_guidance=False, max_sequence_length=length
        )
    else:
        pe, pooled, _ = pipe.encode_prompt(prompts, None, device=CPU, max_sequence_length=length)
    return {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}


@pytest.mark.parametrize("name", PARITY)
def test_encode_text_matches_pipeline(name, built, encoders):
    fam = get_family(name)
    enc = encoders(name)
    assert enc.max_length == fam.facts.max_length
    prompts = ["a red square", "a blue circle on a yellow background"]
    mine = fam.encode_text(enc, prompts)
    pe = mine["prompt_embeds"]
    assert pe.ndim == 3 and pe.shape[0] == 2 and pe.shape[1] >= fam.facts.max_length
    assert not torch.equal(pe[0], pe[1]), "different captions must embed differently"
    ref = _pipeline_encode(_pipe(built(name)), prompts, enc.max_length)
    if isinstance(ref["prompt_embeds"], list):  # the pipeline keeps only the real tokens of each prompt
        mask = mine["prompt_attention_mask"].bool()
        for i, value in enumerate(ref.pop("prompt_embeds")):
            torch.testing.assert_close(mine["prompt_embeds"][i][mask[i]].to(value.dtype), value)
    for key, value in ref.items():
        got = mine[key]
        if "prompt_embeds_mask" in ref:  # variable length: ours is zero-padded (mask 0) past the longest prompt
            got, rest = got[:, : value.shape[1]], got[:, value.shape[1] :]
            assert not rest.any(), key
        assert got.shape == value.shape, key
        torch.testing.assert_close(got.to(value.dtype), value, msg=key)
    for value in mine.values():
        assert value.shape[0] == 2


def _timesteps(fam, b: int) -> torch.Tensor:
    if fam.facts.prediction == "flow_matching":
        return torch.tensor([250.0, 900.0][:b])
    return torch.tensor([10, 900][:b])


def _not_learning(trainable: dict[str, torch.nn.Parameter], loss) -> list[str]:
    """The trainable parameters DDP would stop on: without a gradient at the first backward (its reducer waits for
    every one), or without a finite non-zero one at the second. An SGD step between: an adapter starts with one
    factor at zero, which leaves the other factor's first gradient zero."""
    opt = torch.optim.SGD(list(trainable.values()), lr=0.1)
    loss().backward()
    bad = [n for n, p in trainable.items() if p.grad is None]
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss().backward()
    bad += [n for n, p in trainable.items() if p.grad is None or not (torch.isfinite(p.grad).all() and p.grad.any())]
    return sorted(set(bad))


def _conditioning(fam, text: dict[str, torch.Tensor], noisy: torch.Tensor) -> dict[str, torch.Tensor]:
    """The text tensors, plus control latents for a family that takes them (as the training loop adds them)."""
    if not fam.takes_control:
        return text
    control = torch.randn(noisy.shape, generator=torch.Generator().manual_seed(1))
    return {**text, "control_latents": control}


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("name", FAMILIES)
def test_denoise_forward_backward(name, mode, built, encoders):
    """Every parameter the train stage would train (its own prepare_denoiser: the family's LoRA targets, or every
    weight of a full fine-tune) learns from the loss, so 2-process DDP does not stop at step 2."""
    from tuneline.schemas.train import TrainConfig
    from tuneline.stages.train.model import prepare_denoiser

    fam = get_family(name)
    t = TrainConfig(mode=mode, lora_rank=2)
    den, trainable = prepare_denoiser(fam, built(name), t, torch.float32, CPU)
    noisy = torch.randn(2, fam.facts.latent_channels, 6, 4, generator=torch.Generator().manual_seed(0))
    text = _conditioning(fam, fam.encode_text(encoders(name), ["a red square", "a green circle"]), noisy)

    def loss():
        out = fam.denoise(den, noisy, _timesteps(fam, 2), text)
        assert out.shape == noisy.shape
        return out.float().pow(2).mean()

    assert _not_learning(trainable, loss) == [], f"{name} {mode}: parameters the loss never reaches"
    with torch.no_grad():
        swapped = {k: v.flip(0) for k, v in text.items()}
        plain = fam.denoise(den, noisy, _timesteps(fam, 2), text)
        other = fam.denoise(den, noisy, _timesteps(fam, 2), swapped)
    assert not torch.allclose(plain, other), "the prediction must depend on the text"


@pytest.mark.parametrize("name", [n for n in FAMILIES if get_family(n).text_encoder_lora_targets])
def test_text_encoder_lora_forward_backward(name, built):
    """train.text_encoder_lora: every LoRA weight on the text encoders (and the denoiser's) learns from the loss
    through live encoding, as the train stage's step runs it."""
    from tuneline.schemas.train import TrainConfig
    from tuneline.stages.text import TagAugment
    from tuneline.stages.train.model import prepare_denoiser
    from tuneline.stages.train.textlora import TrainedText

    fam = get_family(name)
    t = TrainConfig(mode="lora", lora_rank=2, text_encoder_lora=True)
    den, trainable = prepare_denoiser(fam, built(name), t, torch.float32, CPU)
    text = TrainedText(fam, built(name), CPU, t, fam.facts.max_length, TagAugment())
    assert fam.facts.text_encoder_lora
    noisy = torch.randn(2, fam.facts.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))

    def loss():
        cond = text.encode(text.strings(["a red square", "a green circle"]))
        return fam.denoise(den, noisy, _timesteps(fam, 2), cond).float().pow(2).mean()

    assert _not_learning({**trainable, **text.params()}, loss) == [], f"{name}: parameters the loss never reaches"


@pytest.mark.parametrize("name", PARITY)
def test_saved_pipeline_loads_and_renders_with_negative(name, built, encoders, tmp_path):
    fam = get_family(name)
    base = built(name)
    den = fam.load_denoiser(base, torch.float32, CPU)
    with torch.no_grad():
        first = next(den.parameters())
        first.add_(0.5)  # stands in for training: the saved folder must carry this denoiser, not the base one
    out = tmp_path / "final"
    fam.save_pipeline(base, den, out)
    for comp in ("vae", "text"):
        assert fam.identity(out, comp) == fam.identity(base, comp)
    assert fam.identity(out, "denoiser") != fam.identity(base, "denoiser")
    pipe = _pipe(out)
    torch.testing.assert_close(next(getattr(pipe, fam.denoiser_component).parameters()), first)
    enc = encoders(name)
    text, negative = fam.encode_text(enc, ["a red square"]), fam.encode_text(enc, ["blurry"])
    # with guidance and no negative, a family that needs one gets "" encoded, as the renderer does
    no_negative = fam.encode_text(enc, [""]) if fam.negative_required else None
    # A video family renders a 5-frame clip (2 latent frames), its first frame compared as an image.
    clip = {"num_frames": 5} if fam.facts.video else {}

    def render(negative):
        # 2 steps: a scheduler with shift_terminal (Qwen-Image) stretches its sigmas by the last one, 0/0 at 1 step.
        kwargs = dict(num_inference_steps=2, height=64, width=64, output_type="np", **clip)
        return _rendered(
            pipe(generator=torch.Generator().manual_seed(0), **kwargs, **fam.prompt_kwargs(text, negative))
        )

    images = render(negative)
    assert images.shape == (1, 64, 64, 3) and torch.isfinite(torch.from_numpy(images)).all()
    plain = render(no_negative)
    assert plain.shape == images.shape
    assert fam.identity(out, "denoiser") != fam.identity(base, "denoiser")


def _rendered(out):
    """The images of a pipeline's output; a video pipeline's clips' first frames."""
    return out.frames[:, 0] if hasattr(out, "frames") else out.images


@pytest.mark.parametrize("name", FAMILIES)
def test_save_pretrained_folder_loads_through_ensure_model(name, built, tmp_path):
    """The path a user's real model takes: a diffusers folder on disk, given as model.path."""
    fam = get_family(name)
    user_dir = tmp_path / "user-model"
    _pipe(built(name)).save_pretrained(user_dir, safe_serialization=True)
    got = fam.ensure_model(str(user_dir), tmp_path / "cache")
    assert got == user_dir.resolve()
    assert not (tmp_path / "cache").exists(), "a folder model needs no conversion"
    ref = fam.load_denoiser(built(name), torch.float32, CPU).state_dict()
    loaded = fam.load_denoiser(got, torch.float32, CPU).state_dict()
    assert ref.keys() == loaded.keys()
    assert all(torch.equal(ref[k], loaded[k]) for k in ref)
    assert fam.load_text_encoders(got, torch.float32, CPU).max_length == fam.facts.max_length
    ref_vae = fam.load_vae(built(name), torch.float32, CPU).state_dict()
    got_vae = fam.load_vae(got, torch.float32, CPU).state_dict()
    assert ref_vae.keys() == got_vae.keys() and all(torch.equal(ref_vae[k], got_vae[k]) for k in ref_vae)


@pytest.mark.parametrize("name", FAMILIES)
def test_missing_component_is_named(name, built, tmp_path):
    fam = get_family(name)
    broken = tmp_path / "broken"
    shutil.copytree(built(name), broken)
    shutil.rmtree(broken / fam.denoiser_component)
    with pytest.raises(ValueError, match=rf"{broken}.*'{fam.denoiser_component}'"):
        fam.ensure_model(str(broken), tmp_path / "cache")
    shutil.copytree(built(name), broken, dirs_exist_ok=True)
    index = json.loads((broken / "model_index.json").read_text())
    last_text = fam.text_components[-1]
    index.pop(last_text)
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"'{last_text}'"):
        fam.ensure_model(str(broken), tmp_path / "cache")


def test_folder_of_another_family_is_refused(built):
    with pytest.raises(ValueError, match="StableDiffusionXLPipeline.*'sd3'"):
        get_family("sd3").ensure_model(str(built("sdxl")), built("sdxl").parent)


def test_half_precision_denoise_keeps_dtype(built, encoders):
    fam = get_family("tiny")
    den = fam.load_denoiser(built("tiny"), torch.bfloat16, CPU)
    text = fam.encode_text(encoders("tiny"), ["a red square"])  # float32 embeds, cast by the adapter
    noisy = torch.randn(1, 4, 8, 8, dtype=torch.bfloat16)
    out = fam.denoise(den, noisy, torch.tensor([500]), text)
    assert out.dtype == torch.bfloat16 and out.shape == noisy.shape


def test_text_length_beyond_encoder_is_refused(built):
    with pytest.raises(ValueError, match="text.max_length 17 exceeds"):
        get_family("tiny").load_text_encoders(built("tiny"), torch.float32, CPU, max_length=17)
