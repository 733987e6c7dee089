"""sdxl_lora_step_vs_diffusers of bench/gpu.py: our SDXL LoRA step against diffusers' own
train_dreambooth_lora_sdxl.py at the same settings (run from --diffusers-examples DIR, never copied here). DIR/site,
where it exists, goes first on the script's PYTHONPATH only: what the script imports beyond the figures' own
packages (torchvision, which transformers imports wherever it is installed: a build for another torch in the
shared site would end every figure)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_setup import STEPS, WARMUP, Bench, caches, median_seconds, result, step_seconds

from tests.trainer import trainer_for

DIFFUSERS_SCRIPT = "train_dreambooth_lora_sdxl.py"
# diffusers' script run in this process's interpreter, reporting its peak GPU memory and wall time at exit.
PEAK_WRAPPER = """
import atexit, runpy, sys, time, torch
start = time.perf_counter()
atexit.register(lambda: print("PEAK", torch.cuda.max_memory_allocated(), "WALL", time.perf_counter() - start,
                              flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def caches_latents(script: Path) -> bool:
    """Whether the script takes --cache_latents. train_dreambooth_lora_sdxl.py has none (diffusers' advanced and
    FLUX scripts have it), so it encodes each step's batch with the VAE; passing the flag would end it at once."""
    return '"--cache_latents"' in script.read_text(encoding="utf-8")


def instance_dir(b: Bench) -> Path:
    """The benchmark's SDXL images without their captions: the script's DreamBoothDataset opens every file of
    --instance_data_dir as an image (a caption beside it ends the script: PIL.UnidentifiedImageError)."""
    images = b.images("sdxl")
    out = images.with_name(f"{images.name}-images-only")
    shutil.rmtree(out, ignore_errors=True)  # afresh: links left from another --work would dangle
    out.mkdir()
    for png in images.glob("*.png"):
        (out / png.name).symlink_to(png)
    return out


def diffusers_args(b: Bench, script: Path, model: str, steps: int, checkpointing: bool) -> list[str]:
    """The script's command line at our settings (rank 16, 1024², batch 1, bf16)."""
    return [
        str(script),
        f"--pretrained_model_name_or_path={model}",
        f"--instance_data_dir={instance_dir(b)}",
        "--instance_prompt=a photo",
        f"--output_dir={b.work / f'diffusers-{steps}-{checkpointing}'}",
        "--resolution=1024",
        "--train_batch_size=1",
        f"--max_train_steps={steps}",
        "--rank=16",
        "--mixed_precision=bf16",
        "--learning_rate=1e-4",
        "--seed=0",
        "--checkpointing_steps=1000000",
        "--report_to=tensorboard",
        *(["--cache_latents"] if caches_latents(script) else []),
        *(["--gradient_checkpointing"] if checkpointing else []),
    ]


def script_env(script: Path) -> dict[str, str]:
    """The script's environment: offline, and its folder's site/ (gpu_session.sh) first on its path."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    site = script.parent / "site"
    if site.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def diffusers_run(b: Bench, script: Path, model: str, steps: int, checkpointing: bool) -> tuple[float, float]:
    """(wall seconds, peak bytes) of diffusers' SDXL LoRA script for `steps` steps at our settings."""
    args = [sys.executable, "-c", PEAK_WRAPPER, *diffusers_args(b, script, model, steps, checkpointing)]
    proc = subprocess.run(args, capture_output=True, text=True, env=script_env(script), cwd=b.work)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PEAK ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{script.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    _, peak, _, wall = line[-1].split()
    return float(wall), float(peak)


def vae_encode_seconds(b: Bench, model: str) -> float:
    """Median seconds of what the script's step does before the UNet when it cannot cache latents: its float32
    VAE encoding one 1024² image and sampling the latent."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(model, subfolder="vae", torch_dtype=torch.float32).to(b.device)
    x = torch.randn(1, 3, b.resolution("sdxl"), b.resolution("sdxl"), device=b.device)
    with torch.no_grad():
        return median_seconds(b, lambda: vae.encode(x).latent_dist.sample())


def sdxl_lora_step_vs_diffusers(b: Bench) -> None:
    """Their s/step from two runs' wall times (the difference leaves out loading and any latent caching) and their
    peak, against ours at the same settings (gradient checkpointing on). Where the script cannot cache latents,
    the VAE encode its steps include (timed here as it runs it) comes off their s/step, so both steps do the same
    work (the script decodes its images once, before training); their peak still holds the VAE, which leans the
    peak comparison our way."""
    import torch

    script = b.examples / DIFFUSERS_SCRIPT
    model = b.model("sdxl")
    short, peak_short = diffusers_run(b, script, model, WARMUP, True)
    long, peak_long = diffusers_run(b, script, model, WARMUP + STEPS, True)
    theirs, their_peak = (long - short) / STEPS, max(peak_short, peak_long) / 2**30
    if not caches_latents(script):
        encode = vae_encode_seconds(b, model)
        print(
            f"{script.name} has no --cache_latents: its {theirs:.4f} s/step include a float32 VAE encode "
            f"({encode:.4f} s), left out of its figure below; its peak holds that VAE too, which leans the "
            "peak comparison our way",
            flush=True,
        )
        theirs -= encode
    cfg = b.config("sdxl-vs-diffusers", "sdxl", {"gradient_checkpointing": True})
    ctx = caches(cfg)
    torch.cuda.reset_peak_memory_stats()
    ours = step_seconds(b, trainer_for(cfg, ctx))
    our_peak = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"sdxl vs diffusers: ours {ours:.4f} s/step, {our_peak:.2f} GiB; theirs {theirs:.4f} s/step, "
        f"{their_peak:.2f} GiB",
        flush=True,
    )
    result(
        "sdxl_lora_step_vs_diffusers",
        ours / theirs,
        "<=",
        1.0,
        also=our_peak <= their_peak,
        peak_vs_diffusers=our_peak / their_peak,
        anchor_peak_vs_diffusers=1.0,
    )
