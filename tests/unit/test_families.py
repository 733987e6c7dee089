"""Family pieces that need no model weights: registry, facts, tokenizers, latent packing, folder checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tuneline.schemas.families import FAMILY_FACTS, facts
from tuneline.stages.families.base import MicroCond
from tuneline.stages.families.common import unwrap
from tuneline.stages.families.flux.adapter import image_ids, pack_latents, unpack_latents
from tuneline.stages.families.folders import required_components
from tuneline.stages.families.registry import family_names, get_family
from tuneline.stages.families.vocab import (
    WORDS,
    build_clip_tokenizer,
    build_t5_tokenizer,
    learn_bpe_merges,
    write_clip_vocab,
)

# Every registered family; the UNet families (4-channel latents, epsilon) and FLUX.2 (32 channels).
FAMILIES = "tiny sd15 sdxl sd3 flux flux_kontext qwen_image qwen_image_edit qwen_image_edit_plus z_image flux2 flux2_klein wan wan22 wan22_ti2v"
UNETS = {"tiny", "sd15", "sdxl"}
FLUX2 = {"flux2", "flux2_klein"}


def test_registry_covers_every_family_with_facts():
    assert set(family_names()) == set(FAMILY_FACTS) == set(FAMILIES.split())
    for name in family_names():
        fam = get_family(name)
        assert fam.facts is FAMILY_FACTS[name]
        assert set(fam.lora_target_modules) >= {"to_q", "to_k", "to_v", "to_out.0"}
    assert get_family("sdxl") is get_family("sdxl")


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown family 'sd2'.*tiny, sd15, sdxl, sd3, flux, flux_kontext, qwen_image"):
        get_family("sd2")
    with pytest.raises(ValueError, match="model.family"):
        facts("sd2")


def test_facts_alignment_and_targets():
    # Wan 2.2 TI2V 5B: one patch of its 16x VAE's latents is 32 pixels
    align = {n: 8 if n in UNETS else 32 if n == "wan22_ti2v" else 16 for n in FAMILIES.split()}
    assert {n: f.alignment for n, f in FAMILY_FACTS.items()} == align
    flow = {n for n, f in FAMILY_FACTS.items() if f.prediction == "flow_matching"}
    assert flow == set(FAMILIES.split()) - UNETS
    assert {n for n, f in FAMILY_FACTS.items() if f.latent_channels == 16} == flow - FLUX2 - {"wan22_ti2v"}


def test_bpe_merges_rebuild_every_word_whole():
    merges = learn_bpe_merges(WORDS)
    assert merges == learn_bpe_merges(WORDS)
    assert len(set(merges)) == len(merges)


def test_clip_tokenizer_whole_words_and_any_ascii(tmp_path):
    tok = build_clip_tokenizer(tmp_path / "tok", 16)
    ids = tok("a red square").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<|startoftext|>", "a</w>", "red</w>", "square</w>", "<|endoftext|>"]
    for word in ("green", "blue", "yellow", "circle"):
        assert len(tok(word).input_ids) == 3, word  # bos, the word, eos
    odd = "Zebra #42 ~{x}| qu'il"
    assert tok.unk_token_id not in tok(odd).input_ids[1:-1]
    padded = tok(["a red square"], padding="max_length", max_length=16).input_ids[0]
    assert len(padded) == 16 and padded[-1] == tok.pad_token_id


def test_clip_vocab_files_are_deterministic(tmp_path):
    write_clip_vocab(tmp_path / "a")
    write_clip_vocab(tmp_path / "b")
    for f in ("vocab.json", "merges.txt"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    vocab = json.loads((tmp_path / "a" / "vocab.json").read_text())
    assert "yellow</w>" in vocab and len(vocab) == len(set(vocab.values()))


def test_t5_tokenizer_whole_words_and_padding(tmp_path):
    tok = build_t5_tokenizer(tmp_path / "t5", 512)
    out = tok(["a blue circle"], padding="max_length", max_length=8)
    assert tok.convert_ids_to_tokens(out.input_ids[0][:4]) == ["▁a", "▁blue", "▁circle", "</s>"]
    assert out.attention_mask[0] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.unk_token_id not in tok("Any ASCII: x=3; y!").input_ids


def test_flux_packing_matches_the_pipeline():
    from diffusers import FluxPipeline

    lat = torch.randn(2, 16, 6, 4)
    packed = pack_latents(lat)
    assert packed.shape == (2, 6, 64)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(lat, 2, 16, 6, 4))
    torch.testing.assert_close(unpack_latents(packed, 6, 4), lat)
    torch.testing.assert_close(unpack_latents(packed, 6, 4), FluxPipeline._unpack_latents(packed, 48, 32, 8))
    torch.testing.assert_close(
        image_ids(6, 4, torch.device("cpu"), torch.float32),
        FluxPipeline._prepare_latent_image_ids(2, 3, 2, "cpu", torch.float32),
    )
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.randn(1, 16, 5, 4))


def test_micro_time_ids_order_and_default():
    fam = get_family("sdxl")
    lat = torch.zeros(2, 4, 6, 4)
    default = fam.micro_time_ids(None, lat)
    assert default.tolist() == [[48, 32, 0, 0, 48, 32]] * 2
    micro = [MicroCond((100, 80), (3, 5), (48, 32)), MicroCond((60, 40), (0, 0), (48, 32))]
    assert fam.micro_time_ids(micro, lat)[0].tolist() == [100, 80, 3, 5, 48, 32]
    with pytest.raises(ValueError, match="batch of 2"):
        fam.micro_time_ids(micro[:1], lat)


def test_prompt_kwargs_negative_optional():
    t = {
        "prompt_embeds": torch.ones(1, 3, 2),
        "pooled_prompt_embeds": torch.ones(1, 2),
        "prompt_attention_mask": torch.ones(1, 3),
    }
    n = {k: v * 0 for k, v in t.items()}
    assert set(get_family("tiny").prompt_kwargs(t, None)) == {"prompt_embeds"}
    assert set(get_family("sdxl").prompt_kwargs(t, n)) == {
        "prompt_embeds",
        "pooled_prompt_embeds",
        "negative_prompt_embeds",
        "negative_pooled_prompt_embeds",
    }
    flux = get_family("flux")
    assert "true_cfg_scale" not in flux.prompt_kwargs(t, {})
    with_neg = flux.prompt_kwargs(t, n)
    assert with_neg["true_cfg_scale"] > 1 and with_neg["max_sequence_length"] == 3
    assert "negative_prompt_attention_mask" not in with_neg


def test_unwrap_sees_through_wrappers():
    inner = torch.nn.Linear(2, 2)

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.module = m

    assert unwrap(Wrapper(Wrapper(inner))) is inner
    assert unwrap(inner) is inner


def _fake_folder(root: Path, cls: str, components: list[str]) -> Path:
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": cls, **{c: ["x", "y"] for c in components}}))
    for c in components:
        (root / c).mkdir()
    return root


def test_folder_checks_name_folder_and_component(tmp_path):
    fam = get_family("sd15")
    with pytest.raises(ValueError, match="no model_index.json"):
        fam.ensure_model(str(tmp_path), tmp_path / "cache")
    wrong = _fake_folder(tmp_path / "flux", "FluxPipeline", ["vae"])
    with pytest.raises(ValueError, match="FluxPipeline.*'sd15'"):
        fam.ensure_model(str(wrong), tmp_path / "cache")
    partial = _fake_folder(tmp_path / "sd", "StableDiffusionPipeline", ["vae", "scheduler", "unet"])
    with pytest.raises(ValueError, match=rf"{partial} lacks component 'text_encoder'"):
        fam.ensure_model(str(partial), tmp_path / "cache")
    empty = _fake_folder(tmp_path / "sd2", "StableDiffusionPipeline", list(required_components(fam.facts)))
    with pytest.raises(ValueError, match="component 'vae' has no config.json"):
        fam.ensure_model(str(empty), tmp_path / "cache")


def test_bad_paths_are_named(tmp_path):
    fam = get_family("sdxl")
    with pytest.raises(ValueError, match="does not exist"):
        fam.ensure_model(str(tmp_path / "nope"), tmp_path / "cache")
    txt = tmp_path / "model.txt"
    txt.write_text("x")
    with pytest.raises(ValueError, match=rf"{txt} is neither a diffusers folder nor"):
        fam.ensure_model(str(txt), tmp_path / "cache")
    junk = tmp_path / "model.safetensors"
    junk.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=rf"cannot load {junk} as a single-file 'sdxl' checkpoint"):
        fam.ensure_model(str(junk), tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir()], "a failed conversion must leave nothing behind"


def test_per_channel_statistics_normalise_as_the_pipeline_does():
    """With latents_mean/std the denoiser sees ((z - mean) / std - shift) * scaling per channel; without them, the
    scalars (old manifests)."""
    from types import SimpleNamespace

    from tuneline.stages.families.base import latent_affine, scale_latents

    z = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    mean, std = [0.5, -1.0, 2.0], [2.0, 0.5, 4.0]
    m = SimpleNamespace(scaling_factor=1.0, shift_factor=0.0, latents_mean=mean, latents_std=std)
    want = (z - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(scale_latents(z, *latent_affine(m)), want)
    old = SimpleNamespace(scaling_factor=0.5, shift_factor=0.1)
    torch.testing.assert_close(scale_latents(z, *latent_affine(old)), (z - 0.1) * 0.5)


@pytest.mark.parametrize("name", ["z_image", "flux2", "flux2_klein"])
def test_pipeline_caps_the_caption_length(name):
    """Families whose pipeline caps captions itself (not the tokenizer) refuse one token more, naming the limit."""
    fam = get_family(name)
    limit = fam.facts.max_length_limit
    fam.check_max_length([], limit)
    with pytest.raises(ValueError, match=rf"text.max_length {limit + 1} exceeds the {limit} tokens family '{name}'"):
        fam.check_max_length([], limit + 1)
