"""Wan 2.2 A14B as ComfyUI distributes it: one `diffusion_models/` file per timestep expert in Wan's original layout
(`wan2.2_t2v_high_noise_14B_...`, `wan2.2_t2v_low_noise_14B_...`), the UMT5 file and the Wan 2.1 VAE file, over a
weightless model.config folder. model.path names either expert's file and the other is found beside it by its
ComfyUI name; each assembled expert computes exactly what the module its file was written from computes, a scaled
fp8 expert holds exactly its fp8 values times their scales, and a one-expert run needs only its own file. A file of
another family, one expert under both names, the same file twice, two experts of different models and a missing
expert file are refused naming the files and the fix (stages/families/wan22/split.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tests.integration import comfy_layout
from tests.integration.test_split_files import _weightless
from tests.integration.test_wan_split_files import _comfy_files, _config, _one_step, _released_structure_vae
from tuneline.stages.common.stage import StageContext
from tuneline.stages.families import resolve
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.shipped import shipped_dir
from tuneline.stages.families.wan22.experts import HIGH, LOW
from tuneline.stages.families.wan22.split import expert_files, sibling

CPU = torch.device("cpu")
F32 = torch.float32
WORDS = {HIGH: "high", LOW: "low"}


def _save(sd: dict[str, torch.Tensor], file: Path) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(file))
    return file


def _original(expert: torch.nn.Module) -> dict[str, torch.Tensor]:
    return comfy_layout.wan_transformer(expert.state_dict())


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    """The tiny A14B flavor, its experts written as ComfyUI's files (float32 in `full/`, scaled fp8 in `fp8/`, the
    low-noise expert only), the UMT5 and VAE files and the weightless config."""
    root = tmp_path_factory.mktemp("wan22split")
    fam = get_family("wan22")
    tiny = fam.ensure_model(None, root / "models")
    vae = _released_structure_vae()
    parts = _comfy_files(get_family("wan"), tiny, root / "parts", vae)
    config = _weightless(tiny, root / "config")
    vae.save_config(config / "vae")
    experts = fam.load_denoiser(tiny, F32, CPU).experts
    full = {
        c: _save({comfy_layout.PREFIX + k: v for k, v in _original(experts[c]).items()},
                 root / "full" / f"wan2.2_t2v_{WORDS[c]}_noise_14B_fp32.safetensors")
        for c in (HIGH, LOW)
    }  # fmt: skip
    fp8 = _save(
        comfy_layout.scaled_fp8(_original(experts[LOW])),
        root / "fp8" / "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
    )
    return SimpleNamespace(fam=fam, tiny=tiny, config=config, full=full, fp8=fp8, umt5=parts["umt5"], vae=parts["vae"])


def test_both_experts_assemble_compute_as_before_and_train(comfy, tmp_path):
    fam = comfy.fam
    files = {"transformer": comfy.full[HIGH], "umt5": comfy.umt5, "vae": comfy.vae}
    cfg = _config(tmp_path, comfy.config, files, family="wan22")
    ctx = StageContext(cfg)
    assembled = resolve.model_dir(ctx)
    # model.path may name either expert's file: the low-noise one gives the same assembled folder (already built).
    low_first = fam.ensure_model(str(comfy.full[LOW]), ctx.workdir / "models", str(comfy.config), str(comfy.umt5),
                                 str(comfy.vae))  # fmt: skip
    assert low_first == assembled
    trainer = _one_step(cfg, ctx)  # a LoRA step on both experts
    assert {n.split(".")[1] for n in trainer.params} == {HIGH, LOW}, "each expert trains its own LoRA"

    torch.manual_seed(0)
    x, t, text = torch.randn(1, 16, 2, 4, 4), torch.tensor([500]), torch.randn(1, 8, 32)
    want = fam.load_denoiser(comfy.tiny, F32, CPU).experts
    got = fam.load_denoiser(assembled, F32, CPU).experts
    out = {c: got[c](x, t, text, return_dict=False)[0] for c in (HIGH, LOW)}
    for c in (HIGH, LOW):
        assert torch.equal(out[c], want[c](x, t, text, return_dict=False)[0]), c
    assert not torch.equal(out[HIGH], out[LOW]), "each expert's place holds its own file, not the other's"


def test_one_expert_needs_only_its_own_scaled_fp8_file(comfy, tmp_path):
    """model.expert low with only the low-noise scaled fp8 file: its expert holds exactly the file's fp8 values times
    their scales, and stands in for the absent high-noise expert (renders). Both experts, or the high-noise one,
    are refused naming the file looked for and model.expert low."""
    fam, fp8 = comfy.fam, comfy.fp8
    more = (str(comfy.config), str(comfy.umt5), str(comfy.vae))
    assembled = fam.ensure_model(str(fp8), tmp_path / "cache", *more, expert="low")
    loaded = {c: _original(fam.load_denoiser(assembled, F32, CPU, expert=e).experts[c])
              for c, e in ((LOW, "low"), (HIGH, "high"))}  # fmt: skip
    file_sd = comfy_layout.scaled_fp8(_original(fam.load_denoiser(comfy.tiny, F32, CPU, expert="low").experts[LOW]))
    exact = comfy_layout.dequantized(file_sd)
    assert set(loaded[LOW]) == set(exact)
    assert all(torch.equal(loaded[LOW][k], v.float()) for k, v in exact.items())
    assert all(torch.equal(loaded[HIGH][k], v) for k, v in loaded[LOW].items())
    pipe = fam.load_pipeline(assembled, F32, CPU)  # what validation renders with: both experts' places filled
    assert torch.equal(pipe.transformer.proj_out.weight, pipe.transformer_2.proj_out.weight)
    want = fp8.with_name("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors")
    for expert in (None, "both", "high"):
        with pytest.raises(ValueError, match=f"trains the high-noise expert, whose file is looked for beside {fp8} as "
                           f"{want.name} .*{want} does not exist.*set model.expert low"):  # fmt: skip
            fam.ensure_model(str(fp8), tmp_path / "cache", *more, expert=expert)


def test_expert_files_are_named_as_comfyui_names_them():
    assert sibling(Path("/m/wan2.2_t2v_high_noise_14B_fp16.safetensors")) == Path(
        "/m/wan2.2_t2v_low_noise_14B_fp16.safetensors"
    )
    assert sibling(Path("Wan2.2-I2V-A14B-LOW-NOISE.safetensors")).name == "Wan2.2-I2V-A14B-HIGH-NOISE.safetensors"
    with pytest.raises(ValueError, match="model.path: wan2.2_t2v_14B.safetensors .*two timestep experts.*high_noise or "
                       "low_noise.*its name has neither.*local diffusers folder"):  # fmt: skip
        expert_files(Path("wan2.2_t2v_14B.safetensors"), shipped_dir("wan22"), None)
    with pytest.raises(ValueError, match="its name has both"):
        expert_files(Path("high_noise_to_low_noise.safetensors"), shipped_dir("wan22"), "high")
    # a folder of one transformer (Wan 2.1's layout) takes one file, whatever its name
    assert expert_files(Path("wan.safetensors"), shipped_dir("wan"), None) == {HIGH: Path("wan.safetensors")}


def _pair(tmp_path: Path, high: Path, low_from) -> tuple[Path, Path]:
    """`high` copied into its own folder, with `low_from(high_copy, low_path)` making the low-noise file beside it."""
    (tmp_path / "pair").mkdir(parents=True)
    a = Path(shutil.copy2(high, tmp_path / "pair" / high.name))
    b = sibling(a)
    low_from(a, b)
    return a, b


def test_mismatched_or_repeated_expert_files_are_refused(comfy, tmp_path):
    config = comfy.config
    a, _ = _pair(tmp_path / "same", comfy.full[HIGH], lambda a, b: os.symlink(a, b))
    with pytest.raises(ValueError, match=f"model.path: {a} and .*low_noise.* are the same file, not two experts"):
        expert_files(a, config, None)
    a, b = _pair(tmp_path / "copy", comfy.full[HIGH], shutil.copy2)
    with pytest.raises(ValueError, match=f"{a} and {b} hold the same weights .*one expert under both names"):
        expert_files(b, config, "low")
    from safetensors.torch import load_file

    def i2v_like(a: Path, b: Path) -> None:  # an image-to-video expert: 36 input channels, not 16
        sd = load_file(str(comfy.full[LOW]))
        w = sd[comfy_layout.PREFIX + "patch_embedding.weight"]
        sd[comfy_layout.PREFIX + "patch_embedding.weight"] = torch.zeros(w.shape[0], 36, *w.shape[2:])
        _save(sd, b)

    a, b = _pair(tmp_path / "i2v", comfy.full[HIGH], i2v_like)
    with pytest.raises(ValueError, match=r"are not the two experts of one model: patch_embedding.weight is \[\d+, 16, "
                       r"1, 2, 2\] in the first and \[\d+, 36, 1, 2, 2\] in the second"):  # fmt: skip
        expert_files(a, config, None)


def test_another_familys_files_named_as_experts_are_refused(comfy, tmp_path):
    """FLUX.2 transformer files under Wan 2.2 expert names: refused naming the file and its family."""
    for word in ("high", "low"):
        torch.manual_seed(len(word))
        flux2 = {"double_stream_modulation_img.lin.weight": torch.randn(8, 4),
                 "double_blocks.0.img_attn.qkv.weight": torch.randn(12, 4)}  # fmt: skip
        _save({comfy_layout.PREFIX + k: v for k, v in flux2.items()}, tmp_path / f"wan2.2_t2v_{word}_noise.safetensors")
    high = tmp_path / "wan2.2_t2v_high_noise.safetensors"
    with pytest.raises(ValueError, match=f"model.path: {high} is a flux2.* transformer file .*model.family is wan22"):
        comfy.fam.ensure_model(str(high), tmp_path / "cache", str(comfy.config))
