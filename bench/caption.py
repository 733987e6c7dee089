"""Benchmark: the caption stage against the model's own `generate` on the same batches.

The model is the tiny Qwen2-VL of `caption.model: tiny` with a language model of realistic decode cost: 12
layers of width 768 (MLP 3072), about 113M parameters, random weights (captions are gibberish; the cost per token
is that of a small real captioner). The dataset is 16 photo-like PNGs of 64-112 px. In one run, on the same images:
  generate  the model loaded once with transformers (AutoProcessor + AutoModelForImageTextToText), then per batch
            of `batch_size`: the processor on the decoded images, and `model.generate` (greedy,
            `max_new_tokens`); model loading and image decoding are not timed;
  stage     `run_stage` of the caption stage with --force on a workdir whose scan is done (untimed): model
            identity, model load, image decode, processor, generate, captions.jsonl, manifest and publish.
Both run on one thread (see main). The machine is shared and its load swings, so the two alternate for ROUNDS rounds (taking turns going first)
and the fastest of each counts.
RESULT caption_vs_generate = (images/s of the stage) / (images/s of generate), goal >= 0.9.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuneline.schemas.caption import CaptionManifest  # noqa: E402
from tuneline.schemas.config import parse_config  # noqa: E402
from tuneline.schemas.demo import DEMO_CONFIG  # noqa: E402
from tuneline.stages.caption import model as vlm, tiny  # noqa: E402
from tuneline.stages.common.stage import StageContext, run_stage  # noqa: E402
from tuneline.stages.pipeline import PIPELINE, stage  # noqa: E402

IMAGES, BATCH, NEW_TOKENS, ROUNDS = 16, 8, 24, 3
TEXT = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
}
PROMPT = "Describe this image in one sentence."


def dataset(root: Path) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i in range(IMAGES):
        w, h = int(rng.integers(64, 113)), int(rng.integers(64, 113))
        base = rng.integers(0, 256, 3)
        noise = rng.normal(0, 25, (h, w, 3))
        Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(root / f"img{i:03d}.png")


def config(workdir: Path, model: Path):
    data = dict(DEMO_CONFIG) | {"workdir": str(workdir)}
    data["dataset"] = {**data["dataset"], "demo": False, "path": "photos"}
    data["caption"] = {
        "model": str(model),
        "policy": "all",
        "prompt": PROMPT,
        "max_new_tokens": NEW_TOKENS,
        "batch_size": BATCH,
        "device": "cpu",
    }
    return parse_config(data)


def reference(folder: Path, images: list[Image.Image]) -> float:
    """Seconds of processor + generate over the batches, the model loaded beforehand."""
    c = vlm.load(folder, PROMPT, "cpu", "auto")
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "num_beams": 1, "repetition_penalty": 1.0}
    start = time.perf_counter()
    for i in range(0, len(images), BATCH):
        c.generate(c.inputs(images[i : i + BATCH]), settings, 0)
    return time.perf_counter() - start


def staged(cfg) -> tuple[float, CaptionManifest]:
    ctx = StageContext(cfg, force=True)
    start = time.perf_counter()
    path, _ = run_stage(ctx, stage("caption"), PIPELINE)
    return time.perf_counter() - start, ctx.store.read(path, CaptionManifest)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    # One thread: on a shared 2-core machine, OpenMP threads spinning for a busy core make a matmul 10x slower.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tuneline-caption-bench-") as tmp:
        root = Path(tmp)
        folder = tiny.build("tiny", root / "model", text=TEXT)
        params = sum(p.numel() for p in vlm.load(folder, PROMPT, "cpu", "auto").model.parameters())
        print(
            f"model: random-weight Qwen2-VL, {params / 1e6:.0f}M parameters; {IMAGES} images, batch {BATCH}, "
            f"{NEW_TOKENS} new tokens"
        )
        dataset(root / "w" / "photos")
        cfg = config(root / "w", folder)
        run_stage(StageContext(cfg), stage("scan"), PIPELINE)
        images = [vlm_image(p) for p in sorted((root / "w" / "photos").glob("*.png"))]
        ref_s, stage_s, m = [], [], None
        for r in range(ROUNDS):  # alternating which goes first, so neither always gets the quieter moment
            if r % 2:
                took, m = staged(cfg)
            ref_s.append(reference(folder, images))
            if not r % 2:
                took, m = staged(cfg)
            stage_s.append(took)
            print(f"round {r + 1}: generate {ref_s[-1]:.2f} s, stage {stage_s[-1]:.2f} s")
        assert m is not None and m.captioned == IMAGES, m
        ref_rate, stage_rate = IMAGES / min(ref_s), IMAGES / min(stage_s)
        ratio = stage_rate / ref_rate
        print(f"generate {ref_rate:.2f} images/s, stage {stage_rate:.2f} images/s (model load and identity included)")
        print(f"RESULT caption_vs_generate {ratio:.3f} goal >= 0.9 {'PASS' if ratio >= 0.9 else 'FAIL'}")


def vlm_image(path: Path) -> Image.Image:
    with Image.open(path) as im:
        return im.convert("RGB")


if __name__ == "__main__":
    main()
