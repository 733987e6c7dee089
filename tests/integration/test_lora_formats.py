"""Our LoRA files, read by independent readers: the kohya file through stock diffusers' `load_lora_weights` (which
converts kohya's layout itself) must give the same effective denoiser weights as our diffusers file, and both must
equal base + (alpha / rank) * up @ down of the trained adapter. alpha != rank, so a lost alpha fails.

The adapter is a real peft LoRA on each family's tiny denoiser with random nonzero up weights (what training would
reach), written by the same `save_final` the train stage calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.integration.family_runs import export_info, tiny_models
from tuneline.schemas.train import TrainConfig
from tuneline.stages.families.common import unwrap
from tuneline.stages.families.registry import get_family
from tuneline.stages.train import kohya
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE, ExportInfo, lora_loader
from tuneline.stages.train.model import prepare_denoiser, save_final

CPU = torch.device("cpu")
RANK, ALPHA = 4, 2.0
INFO = export_info(train_version="abc123", steps=7, num_train_images=5)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("lora-format-models"))


def _trained(
    family: str, model_dir: Path, out: Path, info: ExportInfo = INFO, **train
) -> tuple[object, torch.nn.Module, TrainConfig, list]:
    fam = get_family(family)
    t = TrainConfig(mode="lora", lora_rank=RANK, lora_alpha=ALPHA, **train)
    den, trainable = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainable.items():
            if "lora_B" in name:  # peft starts B at zero; training would have moved it
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    exports = save_final(fam, model_dir, den, t, out, info)
    return fam, den, t, exports


def _expected(den: torch.nn.Module) -> dict[str, torch.Tensor]:
    """module path -> base + (alpha / rank) * B @ A: the merged weight a lost alpha or a dropped module changes."""
    out = {}
    for path, mod in unwrap(den).named_modules():
        if hasattr(mod, "lora_A") and "default" in mod.lora_A:
            delta = mod.lora_B["default"].weight @ mod.lora_A["default"].weight
            out[path] = mod.base_layer.weight.detach() + (ALPHA / RANK) * delta.detach()
    return out


def _merged(
    fam, model_dir: Path, final: Path, weight_name: str, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    pipe = fam.load_pipeline(model_dir, torch.float32, CPU)
    pipe.load_lora_weights(state if state is not None else final, weight_name=weight_name)
    pipe.fuse_lora()
    den = getattr(pipe, fam.denoiser_component)
    return {
        n.removesuffix(".base_layer"): m.weight.detach().clone()
        for n, m in den.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def _compare(expected: dict, got: dict, skip: set[str] = frozenset()) -> None:
    wrong = [p for p, w in expected.items() if p not in skip and not torch.allclose(got[p], w, atol=1e-5)]
    assert not wrong, f"effective weights differ from base + alpha/rank * up @ down (missing or mis-scaled): {wrong}"


@pytest.mark.parametrize("family", ["sd15", "sdxl", "flux"])
def test_kohya_file_matches_diffusers_file_through_diffusers_loader(family, built, tmp_path):
    model_dir = built(family)
    fam, den, t, exports = _trained(family, model_dir, tmp_path / "final")
    expected = _expected(den)
    assert expected, "no LoRA modules were trained"

    # Our diffusers file carries its adapter metadata (alpha): load_lora_weights applies alpha / rank, not 1.
    _compare(expected, _merged(fam, model_dir, tmp_path / "final", DIFFUSERS_FILE))

    state = load_file(tmp_path / "final" / KOHYA_FILE)
    skip: set[str] = set()
    if family == "flux":
        # diffusers' kohya-flux converter splits single_blocks.N.linear1 by Flux.1-dev's fixed widths (3072 x 3 +
        # 12288), which a tiny model cannot have: those are proven by test_flux_fused_rows_follow_diffusers_order.
        fused = {k for k in state if "_linear1." in k}
        state = {k: v for k, v in state.items() if k not in fused}
        skip = {p for p in expected if p.startswith("single_transformer_blocks.")}
    got = _merged(fam, model_dir, tmp_path / "final", KOHYA_FILE, state)
    _compare(expected, got, skip)

    # Coverage: every trained module has its kohya name in the file.
    names = {k.split(".")[0] for k in load_file(tmp_path / "final" / KOHYA_FILE)}
    missing = [p for p in expected if kohya.kohya_name(kohya.target(family, p, unwrap(den)).name) not in names]
    assert not missing, f"trained modules missing from {KOHYA_FILE}: {missing}"
    assert {e["format"] for e in exports} == {"diffusers", "kohya"}


def _fused_delta(state: dict, stem: str) -> torch.Tensor:
    down, up = state[f"{stem}.lora_down.weight"], state[f"{stem}.lora_up.weight"]
    return state[f"{stem}.alpha"] / down.shape[0] * (up @ down)


def test_flux_fused_rows_follow_diffusers_order(built, tmp_path):
    """single_blocks.N.linear1 = [q; k; v; mlp] (the row order diffusers' own single-file converter reads, see
    test_original_names_match_diffusers_single_file_converter): each part's rows of alpha/rank * up @ down are that
    part's trained update (the family trains all four)."""
    model_dir = built("flux")
    fam, den, t, _ = _trained("flux", model_dir, tmp_path / "final")
    state = load_file(tmp_path / "final" / KOHYA_FILE)
    model = unwrap(den)
    for i, block in enumerate(model.single_transformer_blocks):
        delta = _fused_delta(state, f"lora_unet_single_blocks_{i}_linear1")
        h = block.attn.to_q.base_layer.out_features
        assert delta.shape[0] == 3 * h + block.proj_mlp.out_features
        parts = (block.attn.to_q, block.attn.to_k, block.attn.to_v, block.proj_mlp)
        starts = (0, h, 2 * h, 3 * h, delta.shape[0])
        for slot, mod in enumerate(parts):
            want = (ALPHA / RANK) * mod.lora_B["default"].weight @ mod.lora_A["default"].weight
            torch.testing.assert_close(delta[starts[slot] : starts[slot + 1]], want.detach(), msg=f"{i} {slot}")


class _Probe(dict):
    """An original-layout checkpoint for diffusers' single-file converter that makes up every tensor it pops, each
    row holding (tensor number, row), so the converter's own mapping can be read off its output."""

    ROWS = 21504  # Flux.1's single-block linear1 rows (3 x 3072 + 12288), which that converter splits by

    def __init__(self, seeds: list[str]):
        super().__init__()
        self.names: list[str] = []
        for s in seeds:
            self[s] = self._make(s)

    def _make(self, name: str) -> torch.Tensor:
        self.names.append(name)
        return (len(self.names) - 1) * 1_000_000 + torch.arange(self.ROWS, dtype=torch.int64)[:, None]

    def pop(self, name, *default):
        return super().pop(name) if name in self else self._make(name)

    def origin(self, t: torch.Tensor) -> tuple[str, int]:
        v = int(t.flatten()[0])
        return self.names[v // 1_000_000], v % 1_000_000


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_original_names_match_diffusers_single_file_converter(family, built, tmp_path):
    """sd3 (diffusers has no kohya converter for it) and flux's fused rows: every trained module's kohya target is
    the original checkpoint module, and row block, that diffusers' single-file converter maps to that module."""
    from diffusers.loaders import single_file_utils as sfu

    model_dir = built(family)
    fam, den, t, _ = _trained(family, model_dir, tmp_path / "final")
    model = unwrap(den)
    if family == "sd3":
        n = len(model.transformer_blocks)
        probe = _Probe([f"joint_blocks.{i}.x_block.attn.qkv.weight" for i in range(n)] + ["context_embedder.weight"])
        converted = sfu.convert_sd3_transformer_checkpoint_to_diffusers(probe)
    else:
        probe = _Probe(
            [f"double_blocks.{i}.img_attn.qkv.weight" for i in range(len(model.transformer_blocks))]
            + [f"single_blocks.{i}.linear1.weight" for i in range(len(model.single_transformer_blocks))]
            + ["guidance_in.in_layer.weight"]
        )
        converted = sfu.convert_flux_transformer_checkpoint_to_diffusers(probe)
    names = {k.split(".")[0] for k in load_file(tmp_path / "final" / KOHYA_FILE)}
    trained = list(_expected(den))
    assert trained
    problems = []
    for path in trained:
        original, row = probe.origin(converted[f"{path}.weight"])
        tg = kohya.target(family, path, model)
        # Fused q, k, v alone are split in thirds; Flux's single-block linear1 by Flux.1's widths (3072 each).
        width = 3072 if tg.name.endswith("linear1") else probe.ROWS // 3
        want_row = tg.slot * width if tg.parts else 0
        if (original, row) != (f"{tg.name}.weight", want_row) or kohya.kohya_name(tg.name) not in names:
            problems.append(f"{path}: converter reads {original} from row {row}, ours {tg.name} slot {tg.slot}")
    assert not problems, problems


def test_metadata_in_both_headers(built, tmp_path):
    model_dir = built("sd15")
    _trained("sd15", model_dir, tmp_path / "final")
    for name in (DIFFUSERS_FILE, KOHYA_FILE):
        with safe_open(str(tmp_path / "final" / name), framework="pt") as f:
            meta = f.metadata()
        assert all(isinstance(v, str) for v in meta.values())
        assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == str(RANK)
        assert float(meta["ss_network_alpha"]) == ALPHA and meta["ss_base_model_version"] == "sd_v1"
        assert meta["ss_resolution"] == "(64, 64)" and meta["ss_steps"] == "7"
        assert meta["ss_num_train_images"] == "5" and float(meta["ss_training_started_at"]) == INFO.started_at
        assert meta["modelspec.sai_model_spec"] == "1.0.0"
        assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
        assert meta["modelspec.resolution"] == "64x64" and meta["modelspec.date"].startswith("2023-11-14")
        assert meta["tuneline.train_version"] == "abc123" and meta["tuneline.base_identity"] == "sha256:base"
        assert "ss_tag_frequency" not in meta  # captions stay out unless train.metadata_captions
    with safe_open(str(tmp_path / "final" / DIFFUSERS_FILE), framework="pt") as f:
        adapter = json.loads(f.metadata()["lora_adapter_metadata"])
    assert adapter["unet.lora_alpha"] == ALPHA and adapter["unet.r"] == RANK


def test_captions_only_with_metadata_captions(built, tmp_path):
    """Tag counts (kohya's ss_tag_frequency, which model sites display) only when the user allows captions out."""
    from dataclasses import replace

    tagged = replace(INFO, tag_frequency={"red square": 3, "blue circle": 2})
    _trained("sd15", built("sd15"), tmp_path / "off", tagged)
    _trained("sd15", built("sd15"), tmp_path / "on", tagged, metadata_captions=True)
    for name in (DIFFUSERS_FILE, KOHYA_FILE):
        with safe_open(str(tmp_path / "off" / name), framework="pt") as f:
            assert "ss_tag_frequency" not in f.metadata()
        with safe_open(str(tmp_path / "on" / name), framework="pt") as f:
            tags = json.loads(f.metadata()["ss_tag_frequency"])
        assert tags == {"train": {"red square": 3, "blue circle": 2}}


@pytest.mark.parametrize("fmt,files", [("diffusers", {DIFFUSERS_FILE}), ("kohya", {KOHYA_FILE})])
def test_lora_format_writes_only_what_it_names(fmt, files, built, tmp_path):
    model_dir = built("sd15")
    _, _, _, exports = _trained("sd15", model_dir, tmp_path / "final", lora_format=fmt)
    assert {p.name for p in (tmp_path / "final").iterdir()} == files
    assert [e["file"] for e in exports] == [f"final/{f}" for f in files]
    assert exports[0]["format"] == fmt and exports[0]["bytes"] == (tmp_path / "final" / files.pop()).stat().st_size


def test_validation_reads_a_kohya_only_final(built, tmp_path):
    """train.lora_format kohya leaves no diffusers file: the validate stage's renderer loads the kohya one."""
    from tuneline.stages.render.renderer import Renderer

    model_dir = built("sd15")
    fam, den, _, _ = _trained("sd15", model_dir, tmp_path / "final", lora_format="kohya")
    renderer = Renderer.load(fam, model_dir, CPU, torch.float32, adapt=lora_loader(fam.facts.name, tmp_path / "final"))
    renderer.pipe.fuse_lora()
    unet = renderer.pipe.unet
    got = {
        n.removesuffix(".base_layer"): m.weight.detach()
        for n, m in unet.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    _compare(_expected(den), got)
