"""train.export_single_file: a full fine-tune written as one original-layout (LDM) .safetensors, read back by an
independent reader, stock diffusers' `from_single_file` (offline, configs from the base folder): every UNet, VAE
and text encoder weight equals the fine-tuned pipeline's."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.integration.family_runs import export_info
from tuneline.schemas.train import TrainConfig
from tuneline.stages.common.hashing import file_sha256
from tuneline.stages.families.registry import get_family
from tuneline.stages.train.model import save_final
from tuneline.stages.train.singlefile_export import SINGLE_FILE

CPU = torch.device("cpu")
INFO = export_info(train_version="v1", steps=3, num_train_images=2, title="tuneline sd15 fine-tune")


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_full_fine_tune_single_file_loads_in_stock_diffusers(family, tmp_path):
    fam = get_family(family)
    base = fam.ensure_model(None, tmp_path / "models")
    den = fam.load_denoiser(base, torch.float32, CPU)
    with torch.no_grad():  # a "fine-tuned" UNet: every weight moved, so a file holding the base's would fail
        for p in den.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    t = TrainConfig(mode="full", export_single_file=True)
    exports = save_final(fam, base, den, t, tmp_path / "final", INFO)
    single = tmp_path / "final" / SINGLE_FILE
    assert exports[-1] == {
        "file": f"final/{SINGLE_FILE}",
        "format": "single-file",
        "bytes": single.stat().st_size,
        "sha256": file_sha256(single),
    }
    assert exports[0]["file"] == "final" and exports[0]["sha256"] is None

    pipe = fam.pipeline_class.from_single_file(
        str(single), config=str(base), local_files_only=True, **fam.pipeline_load_kwargs()
    )
    tuned = fam.load_pipeline(tmp_path / "final", torch.float32, CPU)
    untouched = fam.load_pipeline(base, torch.float32, CPU)
    for comp in ("unet", "vae", "text_encoder"):
        _same(getattr(tuned, comp).state_dict(), getattr(pipe, comp).state_dict(), comp)
    assert not torch.equal(pipe.unet.conv_in.weight, untouched.unet.conv_in.weight)
    if family == "sdxl":
        # diffusers tells SDXL's two encoders apart in a single file by width, which the tiny ones share: read the
        # second (OpenCLIP names) with diffusers' own OpenCLIP converter, as from_single_file does for real SDXL.
        from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

        state = load_file(single)
        got = convert_open_clip_checkpoint(tuned.text_encoder_2, state, prefix="conditioner.embedders.1.model.")
        _same(tuned.text_encoder_2.state_dict(), got, "text_encoder_2")

    with safe_open(str(single), framework="pt") as f:
        meta = f.metadata()
        assert any(k.startswith("model.diffusion_model.input_blocks.") for k in f.keys())
    arch = {"sd15": "stable-diffusion-v1", "sdxl": "stable-diffusion-xl-v1-base"}[family]
    assert meta["modelspec.architecture"] == arch and meta["tuneline.train_version"] == "v1"
    assert meta["tuneline.base_identity"] == "sha256:base" and meta["modelspec.title"] == "tuneline sd15 fine-tune"


def _same(want: dict, got: dict, comp: str) -> None:
    want = {k.removeprefix("text_model."): v for k, v in want.items() if not k.endswith("position_ids")}
    got = {k.removeprefix("text_model."): v for k, v in got.items() if not k.endswith("position_ids")}
    assert got.keys() == want.keys(), f"{comp}: {sorted(got.keys() ^ want.keys())[:5]}"
    wrong = [k for k in want if not torch.equal(got[k], want[k])]
    assert not wrong, f"{comp}: {wrong[:5]}"
