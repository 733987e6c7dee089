"""The shipped sd3 (SD3 medium) and flux (FLUX.1-dev) folders: every component builds from them on the meta device
with the published parameter counts, the original-layout shapes the single-file check compares are the ones these
configs produce (and diffusers' own converters take them back), the T5 tokenizer derived from Google's spiece.model
gives T5's ids, and a file that fits a shipped folder but holds only the transformer is refused naming the missing
components and model.config."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.loaders import single_file_utils as sfu
from safetensors.torch import save_file
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from tests.integration.original_layout import flux_original, sd3_original
from tuneline.schemas.config import parse_config
from tuneline.stages.families.flux.layout import flux_to_diffusers
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.shipped import SIGNATURES, misfits, resolve_config, shipped_dir

# Published sizes: SD3 medium MMDiT 2,028,328,000; FLUX.1-dev transformer 11,901,408,320; their 16-channel VAE
# 83,819,683; CLIP ViT-L/14 text 123,060,480 (+ 589,824 projection); OpenCLIP bigG text with projection
# 694,659,840; T5 v1.1 XXL encoder 4,762,310,656.
COUNTS = {
    "sd3": {
        "transformer": 2_028_328_000,
        "vae": 83_819_683,
        "text_encoder": 123_650_304,
        "text_encoder_2": 694_659_840,
        "text_encoder_3": 4_762_310_656,
    },
    "flux": {
        "transformer": 11_901_408_320,
        "vae": 83_819_683,
        "text_encoder": 123_060_480,
        "text_encoder_2": 4_762_310_656,
    },
}
TRANSFORMER = {
    "sd3": (SD3Transformer2DModel, sd3_original, sfu.convert_sd3_transformer_checkpoint_to_diffusers),
    "flux": (FluxTransformer2DModel, flux_original, sfu.convert_flux_transformer_checkpoint_to_diffusers),
}
TEXT = {"CLIPTextModel": CLIPTextModel, "CLIPTextModelWithProjection": CLIPTextModelWithProjection}


def _meta_parts(name: str) -> dict[str, torch.nn.Module]:
    import json

    root = shipped_dir(name)
    index = json.loads((root / "model_index.json").read_text())
    cls = TRANSFORMER[name][0]
    with torch.device("meta"):
        parts = {
            "transformer": cls.from_config(cls.load_config(root / "transformer")),
            "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(root / "vae")),
        }
        for comp in (c for c in index if c.startswith("text_encoder")):
            kind = index[comp][1]
            parts[comp] = (
                T5EncoderModel(T5Config.from_pretrained(root / comp))
                if kind == "T5EncoderModel"
                else TEXT[kind](CLIPTextConfig.from_pretrained(root / comp))
            )
    return parts


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_shipped_configs_build_the_published_models(name):
    parts = _meta_parts(name)
    assert {c: sum(p.numel() for p in m.parameters()) for c, m in parts.items()} == COUNTS[name]
    _, to_original, to_diffusers = TRANSFORMER[name]
    state = parts["transformer"].state_dict()
    original = to_original(state)
    shapes = {k.removeprefix("model.diffusion_model."): tuple(v.shape) for k, v in original.items()}
    assert {k: shapes.get(k) for k in SIGNATURES[name]} == SIGNATURES[name], (
        "the single-file check compares shapes these configs do not produce"
    )
    back = to_diffusers(dict(original))  # diffusers' converter, on meta tensors: names and shapes only
    assert back.keys() == state.keys() and all(back[k].shape == state[k].shape for k in state)
    if name == "flux":  # tuneline's own Flux reader (any width) agrees with diffusers' at FLUX.1's width
        ours = flux_to_diffusers(original)
        assert ours.keys() == state.keys() and all(ours[k].shape == state[k].shape for k in state)
    assert get_family(name).pipeline_class.__name__ in (shipped_dir(name) / "model_index.json").read_text()


@pytest.mark.parametrize("name,sub", [("sd3", "tokenizer_3"), ("flux", "tokenizer_2")])
def test_t5_tokenizer_gives_t5_ids(name, sub):
    tok = T5Tokenizer.from_pretrained(shipped_dir(name) / sub)
    assert len(tok) == 32100 and tok.model_max_length == 512
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok("a photo of a cat").input_ids == [3, 9, 1202, 13, 3, 9, 1712, 1]
    assert tok("Hello, World!").input_ids == [8774, 6, 1150, 55, 1]
    assert tok.convert_tokens_to_ids(["<extra_id_0>", "<extra_id_99>"]) == [32099, 32000]
    assert tok("x", padding="max_length", max_length=4).input_ids == [3, 226, 1, 0]


@pytest.mark.parametrize(
    "name,sub,pad", [("sd3", "tokenizer", 49407), ("sd3", "tokenizer_2", 0), ("flux", "tokenizer", 49407)]
)
def test_clip_tokenizers_are_the_derived_ones(name, sub, pad):
    tok = CLIPTokenizer.from_pretrained(shipped_dir(name) / sub)
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert tok("x", padding="max_length", max_length=4).input_ids == [49406, 343, 49407, pad]


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_model_config_names_the_shipped_folder(tmp_path, name):
    cfg = parse_config({"model": {"family": name, "path": "m.safetensors", "config": name}}, workdir=str(tmp_path))
    assert cfg.model.config == name
    other = "flux" if name == "sd3" else "sd3"
    with pytest.raises(
        Exception, match=f"model.config: {other} is the shipped {other} config but model.family is {name}"
    ):
        parse_config({"model": {"family": name, "path": "m.safetensors", "config": other}}, workdir=str(tmp_path))


@pytest.mark.parametrize(
    "name,prefix", [("sd3", "model.diffusion_model."), ("flux", ""), ("flux", "model.diffusion_model.")]
)
def test_transformer_only_file_with_the_shipped_config_is_refused_naming_what_is_missing(tmp_path, name, prefix):
    f = tmp_path / f"{name}.safetensors"
    save_file({prefix + k: torch.zeros(s, dtype=torch.float16) for k, s in SIGNATURES[name].items()}, str(f))
    assert misfits(f, name) == []
    assert resolve_config(name, f, None) == (str(shipped_dir(name)), True)
    with pytest.raises(ValueError) as err:
        get_family(name).ensure_model(str(f), tmp_path / "cache", None)
    msg = str(err.value)
    missing = ["vae", "text_encoder", "text_encoder_2"] + (["text_encoder_3"] if name == "sd3" else [])
    assert msg.startswith(f"model.path: {f} holds the transformer but no weights for {', '.join(missing)}")
    assert f"the shipped {name} config" in msg and "set model.config to a local diffusers folder" in msg


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_file_of_another_size_is_refused_naming_model_config(tmp_path, name):
    shapes = dict(SIGNATURES[name])
    first = next(iter(shapes))  # the patch embedding: a narrower model
    shapes[first] = (1024,) + shapes[first][1:]
    f = tmp_path / f"{name}-narrow.safetensors"
    save_file({k: torch.zeros(s, dtype=torch.float16) for k, s in shapes.items()}, str(f))
    with pytest.raises(ValueError) as err:
        get_family(name).ensure_model(str(f), tmp_path / "cache", name)
    msg = str(err.value)
    assert msg.startswith(f"model.config: {name} ") and f"{first} is [1024," in msg
    assert "Set model.config to a local diffusers folder" in msg


def test_flux_reader_matches_diffusers_converter_at_flux1_width():
    """At FLUX.1's width (3072, which diffusers' converter has written in) tuneline's reader gives diffusers' tensors
    value for value: one double and one single block, random bytes (the conversion only renames, splits and
    swaps, so uint8 keeps it to ~0.6 GB a copy)."""
    cfg = dict(
        FluxTransformer2DModel.load_config(shipped_dir("flux") / "transformer"), num_layers=1, num_single_layers=1
    )
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in flux_original(FluxTransformer2DModel.from_config(cfg).state_dict()).items()}
    gen = torch.Generator().manual_seed(0)
    original = {k: torch.randint(0, 255, s, dtype=torch.uint8, generator=gen) for k, s in shapes.items()}
    ours = flux_to_diffusers(original)
    theirs = sfu.convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
