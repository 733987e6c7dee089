"""The text stage on real tiny encoders: what it stores, that cached and live conditioning are the same tensors,
caption dropout and variants with the cache, the cache switched off, validation prompts, and staleness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tuneline.schemas.config import parse_config
from tuneline.schemas.text import TextManifest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, run_stage, status
from tuneline.stages.families import resolve as models
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.render.prompts import batch_of, encode_prompts
from tuneline.stages.text.live import LiveText, open_text
from tuneline.stages.text.store import TextCache
from tuneline.stages.text.variants import TagAugment

CPU = torch.device("cpu")
# Duplicates and an uncaptioned image on purpose: each distinct string is encoded once, "" is row 0.
CAPTIONS = ["red, square, bright", "blue, circle", "red, square, bright", "green", ""]
DISTINCT = ["red, square, bright", "blue, circle", "green"]


def write_dataset(folder: Path, captions: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, caption in enumerate(captions):
        Image.new("RGB", (64, 64), (50 * i, 120, 200)).save(folder / f"{i}.png")
        if caption:
            (folder / f"{i}.txt").write_text(caption, encoding="utf-8")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One workdir for every test: configs differ, so versions coexist and the tiny models are built once."""
    root = tmp_path_factory.mktemp("text-cache")
    write_dataset(root / "data", CAPTIONS)
    return root


def make_ctx(root: Path, family: str = "tiny", validate: dict | None = None, **text) -> StageContext:
    cfg = parse_config(
        {
            "dataset": {"path": str(root / "data")},
            "model": {"family": family, "device": "cpu"},
            "text": text,
            "validate": validate or {},
        },
        workdir=str(root / "work"),
    )
    return StageContext(cfg)


def build(ctx: StageContext, *names: str) -> Path:
    path = None
    for name in names:
        path, _ = run_stage(ctx, stage(name), PIPELINE)
    return path


def text_artifact(ctx: StageContext) -> tuple[Path, TextManifest]:
    path = build(ctx, "scan", "text")
    return path, ctx.store.read(path, TextManifest)


def live(ctx: StageContext, manifest: TextManifest) -> LiveText:
    return LiveText(
        models.family(ctx.cfg),
        models.model_dir(ctx),
        CPU,
        torch.float32,
        manifest.max_length,
        augment=TagAugment.from_manifest(manifest),
    )


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_each_distinct_caption_is_encoded_once(root):
    ctx = make_ctx(root)
    path, m = text_artifact(ctx)
    assert [r["text"] for r in read_jsonl(path / "strings.jsonl")] == ["", *DISTINCT]
    assert {r["caption"]: r["rows"] for r in read_jsonl(path / "captions.jsonl")} == {
        "": [0],
        "red, square, bright": [1],
        "blue, circle": [2],
        "green": [3],
    }
    assert (m.count, m.captions, m.variants, m.enabled) == (4, 4, 1, True)
    assert (m.max_length, m.padding) == (16, "max_length")
    assert m.config["text"]["max_length"] == 16 and m.config["text"]["padding"] == "max_length"
    assert m.encoder_identity == models.identity(ctx, "text") == m.inputs["text_encoders"]
    assert {k: (tuple(v.shape), v.dtype) for k, v in m.fields.items()} == {"prompt_embeds": ((16, 32), "float32")}


def test_cached_and_live_conditioning_are_the_same(root):
    ctx = make_ctx(root)
    path, m = text_artifact(ctx)
    cache = open_text(m, path, models.family(ctx.cfg), models.model_dir(ctx), CPU, torch.float32)
    assert isinstance(cache, TextCache)
    batch = ["green", "red, square, bright", "", "green"]
    assert_same(cache.get(batch), live(ctx, m).get(batch))


def test_caption_dropout_reads_the_cached_empty_caption(root):
    """The trainer replaces a dropped caption by "": the cache answers it from row 0, the empty caption's
    embedding, not from any image's caption (and an uncaptioned image maps to the same row)."""
    ctx = make_ctx(root)
    path, m = text_artifact(ctx)
    cache = TextCache(path, list(m.fields))
    assert cache.rows(["", "blue, circle", ""]) == [0, 2, 0]
    got = cache.get(["", "blue, circle", ""])["prompt_embeds"]
    assert torch.equal(got[0], cache.arrays["prompt_embeds"][0]) and torch.equal(got[0], got[2])
    empty = live(ctx, m).get([""])["prompt_embeds"][0]
    torch.testing.assert_close(got[0], empty, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got[0], got[1]), "the empty caption must embed differently from a real one"


def test_variants_are_cached_and_match_live(root):
    ctx = make_ctx(root, caption_variants=3, shuffle_tags=True, tag_dropout=0.3, seed=2)
    path, m = text_artifact(ctx)
    aug = TagAugment.from_manifest(m)
    assert (m.variants, aug) == (3, TagAugment(3, True, 0.3, 0, 2))
    strings = [r["text"] for r in read_jsonl(path / "strings.jsonl")]
    index = {r["caption"]: r["rows"] for r in read_jsonl(path / "captions.jsonl")}
    for caption, rows in index.items():
        assert [strings[r] for r in rows] == aug.all(caption)
    assert len(strings) == len(set(strings)) == m.count
    assert len(set(strings)) > 4, "shuffling three tags should add strings"
    cache, source = TextCache(path, list(m.fields)), live(ctx, m)
    batch, ids = ["red, square, bright"] * 3 + ["", "blue, circle"], [0, 1, 2, 2, 1]
    assert source.strings(batch, ids) == [aug.variant(c, v) for c, v in zip(batch, ids)]
    assert_same(cache.get(batch, ids), source.get(batch, ids))
    assert torch.equal(cache.get(batch)["prompt_embeds"], cache.get(batch, [0] * 5)["prompt_embeds"])
    with pytest.raises(IndexError, match="variant 3"):
        cache.get(["green"], [3])
    assert m.config["text"]["augment"] == {"shuffle_tags": True, "tag_dropout": 0.3, "keep_tags": 0, "seed": 2}


def test_cache_off_publishes_settings_only_and_encodes_live(root):
    ctx = make_ctx(root, enabled=False, caption_variants=2, shuffle_tags=True)
    path, m = text_artifact(ctx)
    assert m.enabled is False and m.fields == {} and m.count == 0 and m.files == []
    assert (m.max_length, m.variants, m.padding) == (16, 2, "max_length")
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json"]
    with pytest.raises(ValueError, match="text.enabled false"):
        TextCache(path, ["prompt_embeds"])
    source = open_text(m, path, models.family(ctx.cfg), models.model_dir(ctx), CPU, torch.float32)
    assert isinstance(source, LiveText) and source.variants == 2
    cached_path, cached_m = text_artifact(make_ctx(root, caption_variants=2, shuffle_tags=True))
    batch, ids = ["red, square, bright", "", "blue, circle"], [1, 1, 0]
    assert_same(source.get(batch, ids), TextCache(cached_path, list(cached_m.fields)).get(batch, ids))


def test_flux_stores_every_field_with_its_dtype(root):
    ctx = make_ctx(root, family="flux", max_length=24)
    path, m = text_artifact(ctx)
    assert {k: (tuple(v.shape), v.dtype) for k, v in m.fields.items()} == {
        "prompt_embeds": ((24, 32), "float32"),
        "pooled_prompt_embeds": ((32,), "float32"),
        "prompt_attention_mask": ((24,), "int64"),
    }
    cache = open_text(m, path, models.family(ctx.cfg), models.model_dir(ctx), CPU, torch.float32)
    batch = ["blue, circle", "", "green"]
    got = cache.get(batch)
    assert got["prompt_attention_mask"].dtype == torch.int64
    assert got["prompt_attention_mask"][1].sum() < got["prompt_attention_mask"][0].sum()
    assert_same(got, live(ctx, m).get(batch))


def test_float16_storage_keeps_masks_exact(root):
    ctx = make_ctx(root, family="flux", max_length=24, dtype="float16")
    path, m = text_artifact(ctx)
    assert m.fields["prompt_embeds"].dtype == "float16" and m.fields["prompt_attention_mask"].dtype == "int64"
    got = TextCache(path, list(m.fields)).get(["green"])
    ref = live(ctx, m).get(["green"])
    assert torch.equal(got["prompt_attention_mask"], ref["prompt_attention_mask"])
    torch.testing.assert_close(got["prompt_embeds"].float(), ref["prompt_embeds"], rtol=1e-2, atol=1e-2)


def test_open_text_refuses_a_mismatched_artifact(root):
    ctx = make_ctx(root)
    path, m = text_artifact(ctx)
    fam, model_dir = models.family(ctx.cfg), models.model_dir(ctx)
    with pytest.raises(ValueError, match="built for family tiny, model.family is sd15"):
        open_text(m, path, models.family(make_ctx(root, family="sd15").cfg), model_dir, CPU, torch.float32)
    wrong = TextManifest.model_validate(
        m.model_dump() | {"fields": {"prompt_embeds": {"shape": (77, 32), "dtype": "float32"}}}
    )
    with pytest.raises(ValueError, match=r"holds \(16, 32\) float32, its manifest says \(77, 32\)"):
        open_text(wrong, path, fam, model_dir, CPU, torch.float32)


def test_validation_prompts_are_encoded_once_and_cached_by_key(root, tmp_path):
    ctx = make_ctx(root)
    fam = models.family(ctx.cfg)
    enc = fam.load_text_encoders(models.model_dir(ctx), torch.float32, CPU)
    calls: list[int] = []

    def loader():
        calls.append(1)
        return enc

    prompts = ["a red square", "", "a blue circle", ""]
    file = tmp_path / "prompts.safetensors"
    first = encode_prompts(fam, loader, prompts, cache=file, key="k1")
    assert list(first) == ["a red square", "", "a blue circle"] and calls == [1]
    ref = fam.encode_text(enc, ["a red square", "", "a blue circle"])
    for i, p in enumerate(first):
        assert first[p]["prompt_embeds"].shape == (1, 16, 32)
        torch.testing.assert_close(first[p]["prompt_embeds"][0], ref["prompt_embeds"][i], rtol=1e-5, atol=1e-6)
    again = encode_prompts(fam, loader, ["a blue circle", ""], cache=file, key="k1")
    assert calls == [1], "every prompt was in the file: the encoders are not loaded"
    assert torch.equal(again["a blue circle"]["prompt_embeds"], first["a blue circle"]["prompt_embeds"])
    mixed = encode_prompts(fam, loader, ["a red square", "a green circle"], cache=file, key="k1")
    assert calls == [1, 1], "a new prompt loads the encoders, the cached one is read"
    assert torch.equal(mixed["a red square"]["prompt_embeds"], first["a red square"]["prompt_embeds"])
    encode_prompts(fam, loader, ["a blue circle"], cache=file, key="k2")
    assert calls == [1, 1, 1], "another key (encoder, length, dtype) never reuses old embeddings"
    file.write_bytes(b"not safetensors")
    assert set(encode_prompts(fam, enc, ["x"], cache=file, key="k2")) == {"x"}
    assert set(encode_prompts(fam, enc, ["y", "x"], cache=file, key="k2")) == {"y", "x"}
    text, negative = batch_of(mixed, ["a red square", "a green circle"], CPU), batch_of(first, ["", ""], CPU)
    kwargs = fam.prompt_kwargs(text, negative)
    assert kwargs["prompt_embeds"].shape == kwargs["negative_prompt_embeds"].shape == (2, 16, 32)


def test_staleness_follows_the_artifact_contract(tmp_path):
    """max_length and variants make text stale, never scan or latents; validation prompts and speed settings
    change nothing. (Its own workdir: the reason compares with the latest text version built there.)"""
    write_dataset(tmp_path / "data", CAPTIONS)
    ctx = make_ctx(tmp_path)
    build(ctx, "scan", "latents", "text")

    def states(c: StageContext) -> dict[str, tuple[str, str]]:
        return {s.stage: (s.state, s.reason) for s in status(c, PIPELINE)}

    assert [states(ctx)[s][0] for s in ("scan", "latents", "text")] == ["fresh"] * 3
    for change, reason in (
        ({"max_length": 8}, "config text.max_length: 16 -> 8"),
        ({"caption_variants": 2, "shuffle_tags": True}, "config text.caption_variants: 1 -> 2"),
    ):
        now = states(make_ctx(tmp_path, **change))
        assert [now[s][0] for s in ("scan", "latents")] == ["fresh", "fresh"], change
        assert now["text"][0] == "stale" and reason in now["text"][1], now["text"]
    for same in (
        make_ctx(tmp_path, batch_size=1),
        make_ctx(tmp_path, validate={"prompts": [{"prompt": "other"}]}),
        make_ctx(tmp_path, max_length=16),
    ):
        assert states(same)["text"][0] == "fresh"


def test_manifest_round_trips(root):
    path, m = text_artifact(make_ctx(root))
    raw = json.loads((path / "manifest.json").read_text())
    assert raw["stage"] == "text" and raw["index"] == "captions.jsonl" and raw["strings"] == "strings.jsonl"
    assert TextManifest.model_validate(raw) == m
