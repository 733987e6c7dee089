"""Benchmark: what the stages hold in memory at real size, against bare scripts doing the same work.

The model is the full-size SD1.5 architecture (UNet 860M, VAE 84M, CLIP ViT-L text encoder 123M parameters;
random weights, float32 on CPU), one 512x512 bucket, batch 1, LoRA rank 16. Each side runs in its own fresh
process and its peak resident set size is read from the kernel (getrusage of the finished process):
- the train stage (torchrun, one process: the worker is the largest descendant) for one LoRA step, against a bare
  script that loads only the UNet from the same folder, adds the same LoRA and runs one step (forward, MSE,
  backward, AdamW) on tensors of the same shapes;
- the latents stage (in-process) against a bare loop that loads the VAE and encodes the same images.
A ratio above 1 is memory the stage holds beyond the work itself (other models, copies, caches).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESOLUTION = 512
RANK = 16
GOAL = 1.15
IMAGES = 2
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # the sd15 family's (stages/families/common.py)

# The bare references: the same work as the stage, nothing else.
PURE_TRAIN = """
import resource, sys, torch
from diffusers import UNet2DConditionModel
from peft import LoraConfig
folder, rank, targets = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
torch.manual_seed(0)
unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet").requires_grad_(False)
unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets))
params = [p for p in unet.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4, fused=True)  # the train stage's kernel on one device (adamw_kernel)
x, text = torch.randn(1, 4, 64, 64), torch.randn(1, 77, 768)
pred = unet(x, torch.tensor([500]), encoder_hidden_states=text).sample
torch.nn.functional.mse_loss(pred, torch.randn_like(pred)).backward()
opt.step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

PURE_LATENTS = """
import resource, sys, numpy as np, torch
from diffusers import AutoencoderKL
from PIL import Image
vae = AutoencoderKL.from_pretrained(sys.argv[1], subfolder="vae").eval().requires_grad_(False)
with torch.no_grad():
    for path in sys.argv[2:]:
        px = torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), np.float32) / 127.5 - 1).permute(2, 0, 1)
        vae.encode(px[None]).latent_dist.mean
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

# The stages, each in a fresh process as a user's command runs them.
STAGE = """
import json, resource, sys
from tuneline.schemas.config import parse_config
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stage
cfg = parse_config(json.loads(open(sys.argv[1]).read()))
run_stage(StageContext(cfg), stage(sys.argv[2]), PIPELINE)
who = resource.RUSAGE_CHILDREN if sys.argv[2] == "train" else resource.RUSAGE_SELF
print(resource.getrusage(who).ru_maxrss)
"""
# (scan and text run through STAGE too, only so that nothing heavy is ever loaded in the bench's own process)


def make_model(root: Path) -> Path:
    """The sd15 family's folder layout (tokenizer, scheduler) with full-size SD1.5 components, random weights."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from tuneline.stages.families.registry import get_family
    from tuneline.stages.families.shipped import shipped_dir

    fam = get_family("sd15")
    assert fam.lora_target_modules == LORA_TARGETS, "the bare reference must train the same LoRA layers"
    base = fam.ensure_model(None, root / "models")
    folder = root / "sd15-full"
    shutil.copytree(base, folder)
    released = shipped_dir("sd15")  # the released model's configs (model.config: sd15)
    torch.manual_seed(0)
    for name, model in (
        ("unet", UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(released / "unet"))),
        ("vae", AutoencoderKL.from_config(AutoencoderKL.load_config(released / "vae"))),
        ("text_encoder", CLIPTextModel(CLIPTextConfig.from_pretrained(released / "text_encoder"))),
    ):
        shutil.rmtree(folder / name)
        model.save_pretrained(folder / name, safe_serialization=True)
        del model
    return folder


def make_images(folder: Path) -> list[Path]:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    out = []
    for i in range(IMAGES):
        rng = np.random.default_rng(i)
        small = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((RESOLUTION, RESOLUTION), Image.Resampling.BICUBIC)
        img.save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"photo {i}")
        out.append(folder / f"img{i}.png")
    return out


def peak_mb(args: list[str]) -> float:
    """Run a fresh Python process; it prints its own (or its children's) peak RSS in KiB as its last line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{args[:3]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    # This process stays small: a child's peak RSS starts at its parent's size when it is forked, so the model is
    # built and every stage runs in a child of its own.
    from tuneline.schemas.config import parse_config

    with tempfile.TemporaryDirectory(prefix="tuneline-memory-") as tmp:
        root = Path(tmp)
        model = root / "sd15-full"
        subprocess.run(
            [sys.executable, __file__, "--make-model", str(root)],
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
        )
        images = make_images(root / "data")
        cfg = parse_config(
            {
                "dataset": {"path": str(root / "data")},
                "model": {"family": "sd15", "path": str(model), "device": "cpu"},
                "buckets": {"resolution": RESOLUTION},
                "latents": {"batch_size": 1},
                "train": {
                    "mode": "lora",
                    "lora_rank": RANK,
                    "batch_size": 1,
                    "processes": 1,
                    "steps": 1,
                    "threads_per_process": os.cpu_count() or 1,
                },
                "validate": {"learning_check": False},
            },
            workdir=str(root / "work"),
        )
        spec = root / "config.json"
        spec.write_text(json.dumps(cfg.dump()))
        peak_mb(["-c", STAGE, str(spec), "scan"])
        latents = peak_mb(["-c", STAGE, str(spec), "latents"])
        bare_latents = peak_mb(["-c", PURE_LATENTS, str(model), *map(str, images)])
        peak_mb(["-c", STAGE, str(spec), "text"])
        train = peak_mb(["-c", STAGE, str(spec), "train"])
        targets = ",".join(LORA_TARGETS)
        bare_train = peak_mb(["-c", PURE_TRAIN, str(model), str(RANK), targets])
    print(
        f"latents stage peak RSS {latents:.0f} MB, bare VAE-encoder loop {bare_latents:.0f} MB "
        f"(ratio {latents / bare_latents:.3f})"
    )
    print(f"train stage worker peak RSS {train:.0f} MB, bare UNet LoRA step {bare_train:.0f} MB")
    ratio = train / bare_train
    print(f"RESULT train_peak_rss_vs_pure_step {ratio:.3f} goal <= {GOAL} {'PASS' if ratio <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-model"]:
        make_model(Path(sys.argv[2]))
    else:
        main()
