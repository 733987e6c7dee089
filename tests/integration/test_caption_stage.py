"""The caption stage with the tiny vision-language models: its artifact, each policy, incremental reruns, the
LLaVA-style path, and a killed build that publishes nothing and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.integration.test_train_support import small_config
from tuneline.schemas.caption import CaptionManifest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, run_stage, status
from tuneline.stages.pipeline import PIPELINE, stage

pytestmark = pytest.mark.slow
COLORS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}
USER = {"red": "a red square", "green": "a green square"}  # blue and yellow have no caption


def make_dataset(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i, (name, rgb) in enumerate(COLORS.items()):
        Image.new("RGB", (48 + 8 * i, 64), rgb).save(root / f"{name}.png")
        if name in USER:
            (root / f"{name}.txt").write_text(USER[name])


def cfg_for(workdir: Path, **caption):
    data = small_config(
        workdir,
        {"steps": 2, "processes": 1},
        caption={"model": "tiny", "max_new_tokens": 6, "batch_size": 4, **caption},
    ).dump()
    data["dataset"] |= {"demo": False, "path": "data"}
    from tuneline.schemas.config import parse_config

    return parse_config(data)


def build(cfg, force: bool = False):
    ctx = StageContext(cfg, force=force)
    run_stage(ctx, stage("scan"), PIPELINE)
    path, _ = run_stage(ctx, stage("caption"), PIPELINE)
    return ctx.store.read(path, CaptionManifest), {r["path"]: r for r in read_jsonl(path / "captions.jsonl")}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    wd = tmp_path_factory.mktemp("caption") / "w"
    make_dataset(wd / "data")
    return wd


@pytest.fixture(scope="module")
def all_policy(workdir):
    return build(cfg_for(workdir, policy="all", trigger="sks"))


def test_artifact_rows_manifest_and_trigger(workdir, all_policy):
    m, rows = all_policy
    assert set(rows) == {f"{c}.png" for c in COLORS}
    assert (m.images, m.captioned, m.reused, m.user) == (4, 4, 0, 0)
    assert m.architecture == "Qwen2VLForConditionalGeneration" and len(m.model_identity) == 64
    assert m.prompt and m.decoding["max_new_tokens"] == 6 and m.policy == "all"
    for r in rows.values():
        assert r["source"] == "model" and r["model_caption"]
        assert r["caption"] == f"sks, {r['model_caption']}"
        assert len(r["sha256"]) == 64
    # Deterministic: the same model and settings caption the same image the same way.
    assert len({r["model_caption"] for r in rows.values()}) >= 2
    assert not any((workdir / "data").glob("*.json*"))  # the dataset folder is never written
    assert sorted(p.name for p in (workdir / "data").iterdir()) == sorted(
        [f"{c}.png" for c in COLORS] + [f"{c}.txt" for c in USER]
    )


@pytest.mark.parametrize("policy", ["missing", "prefix", "suffix"])
def test_policies(workdir, all_policy, policy):
    _, every = all_policy
    m, rows = build(cfg_for(workdir, policy=policy))
    assert m.captioned == 0, "model captions of the same images and settings are reused"
    for name in COLORS:
        r, model = rows[f"{name}.png"], every[f"{name}.png"]["model_caption"]
        user = USER.get(name)
        if user is None:
            assert (r["caption"], r["source"]) == (model, "model")
        elif policy == "missing":
            assert (r["caption"], r["source"], r["model_caption"]) == (user, "user", None)
        elif policy == "prefix":
            assert r["caption"] == f"{model}, {user}"
        else:
            assert r["caption"] == f"{user}, {model}"


def test_text_reads_the_stage_captions(workdir, all_policy):
    cfg = cfg_for(workdir, policy="all", trigger="sks")
    ctx = StageContext(cfg)
    path, _ = run_stage(ctx, stage("text"), PIPELINE)
    strings = {r["caption"] for r in read_jsonl(path / "captions.jsonl")}
    assert strings - {""} == {r["caption"] for r in all_policy[1].values()}  # "": caption dropout
    text = json.loads((path / "manifest.json").read_text())
    rows = {r.stage: r for r in status(StageContext(cfg), PIPELINE)}
    assert text["upstream"]["caption"] == rows["caption"].version
    assert list(rows)[:2] == ["scan", "caption"] and rows["caption"].state == "fresh"
    off = {r.stage for r in status(StageContext(small_config(workdir, {"steps": 2})), PIPELINE)}
    assert "caption" not in off


def test_incremental(tmp_path, all_policy, workdir):
    import shutil

    w = tmp_path / "w"
    shutil.copytree(workdir, w, symlinks=True)
    base = dict(policy="all", trigger="sks")
    build(cfg_for(w, **base))  # the copy's dataset lies elsewhere: rescan, reuse every caption
    Image.new("RGB", (64, 40), (250, 120, 10)).save(w / "data" / "orange.png")
    m, rows = build(cfg_for(w, **base))
    assert (m.captioned, m.reused) == (1, 4), "an added image is the only one captioned"
    m2, rows2 = build(cfg_for(w, **base, prompt="List the colors."))
    assert (m2.captioned, m2.reused) == (5, 0), "a changed prompt re-captions everything the model covers"
    # A hand-edited sidecar changes exactly that image's caption (prefix keeps the user's words).
    before = build(cfg_for(w, policy="prefix"))[1]
    (w / "data" / "red.txt").write_text("a red square on a table")
    m3, after = build(cfg_for(w, policy="prefix"))
    assert m3.captioned == 0
    changed = {p for p in after if after[p]["caption"] != before[p]["caption"]}
    assert changed == {"red.png"} and after["red.png"]["caption"].endswith("a red square on a table")


def test_llava_style(workdir):
    cfg = cfg_for(workdir, model="tiny:llava", policy="all")
    m, rows = build(cfg)
    assert m.architecture == "LlavaForConditionalGeneration" and m.captioned == 4
    m2, rows2 = build(cfg, force=True)
    assert m2.captioned == 4 and {p: r["caption"] for p, r in rows2.items()} == {
        p: r["caption"] for p, r in rows.items()
    }


KILLED = """
import sys
from tests.integration.test_caption_stage import build, cfg_for
from pathlib import Path
build(cfg_for(Path(sys.argv[1]), policy="all", batch_size=1, max_new_tokens=24))
"""


def test_killed_build_publishes_nothing_and_resumes(tmp_path):
    w = tmp_path / "w"
    make_dataset(w / "data")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(w)], cwd=root, env=env, start_new_session=True)
    stage_dir = w / "artifacts" / "caption"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        done = list(stage_dir.glob(".*/generated.jsonl"))
        if done and len(done[0].read_text().splitlines()) >= 1:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the build finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not [p for p in stage_dir.iterdir() if not p.name.startswith(".")], "a killed build published"
    got = len(list(stage_dir.glob(".*/generated.jsonl"))[0].read_text().splitlines())
    m, rows = build(cfg_for(w, policy="all", batch_size=1, max_new_tokens=24))
    assert m.resumed == got and m.captioned == 4 and len(rows) == 4
