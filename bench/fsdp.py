"""Benchmark: per-process peak memory of a full fine-tune sharded by FSDP against the same run under DDP.

The model is the flux family's tiny pipeline with its transformer widened to ~150M parameters (random weights,
float32 on CPU), large enough that weights, gradients and AdamW's state (16 bytes per parameter under DDP)
dominate the interpreter. Each side is 2 gloo processes under torchrun in the environment the trainer's launcher
gives it (under FSDP on the CPU: glibc's malloc tunables, stages/train/fsdp.py), running the trainer's own pieces: the
denoiser loaded by prepare_denoiser, wrapped by collectives.wrap (DDP) or sharded by fsdp.shard (FSDP), the
family's denoise on a batch of random latents and text, the MSE, backward, gradient clipping and an AdamW step.
Each worker reports its own peak resident set size (getrusage), what it held before loading the model (the
interpreter with torch, diffusers and tuneline imported: the same on both sides, and the floor of the ratio) and its
mean step time after the first step.

Prints the larger rank's peak under each and the step-time ratio; the RESULT is FSDP's peak over DDP's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL = 0.6
STEPS = 4
BATCH, EDGE = 2, 16  # latent edge: activations stay small beside the weights
WIDE = dict(
    num_layers=4, num_single_layers=6, attention_head_dim=64, num_attention_heads=12, axes_dims_rope=(16, 24, 24)
)


def make_model(root: Path) -> Path:
    """The flux tiny pipeline, its transformer replaced by a wider one of the same family."""
    from diffusers import FluxTransformer2DModel

    from tuneline.stages.families.registry import get_family

    fam = get_family("flux")
    fam.build_tiny(root)
    config = dict(FluxTransformer2DModel.load_config(root / "transformer"))
    wide = FluxTransformer2DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")} | WIDE)
    wide.save_pretrained(root / "transformer", safe_serialization=True)
    return root


def worker(parallelism: str, model_dir: str, out: str) -> None:
    """One rank: load, wrap or shard, STEPS optimizer steps; writes its peak RSS and step time."""
    import torch

    from tuneline.schemas.train import TrainConfig
    from tuneline.stages.families.common import unwrap
    from tuneline.stages.families.registry import get_family
    from tuneline.stages.train import collectives, fsdp, fsdpload
    from tuneline.stages.train.model import prepare_denoiser
    from tuneline.stages.train.optimizers import build_optimizer

    idle_mb = _peak_mb()
    cpu = torch.device("cpu")
    collectives.init(cpu)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    fam, t = get_family("flux"), TrainConfig(mode="full", parallelism=parallelism, validate_every=0)
    shards = world if parallelism == "fsdp" else 1
    # as the trainer does (stages/train/loop.py): sharded, each rank builds a skeleton and loads its own shard only
    load = fsdpload.skeleton(fam) if parallelism == "fsdp" else None
    den, params = prepare_denoiser(fam, Path(model_dir), t, torch.float32, cpu, shards=shards, load=load)
    if parallelism == "fsdp":
        params, model = fsdp.shard(den, fam, t, cpu, None, Path(model_dir)), den
    else:
        model = collectives.wrap(den, params, cpu)
    opt = build_optimizer(list(params.values()), t)
    config = unwrap(den).config
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        noisy = torch.randn(BATCH, fam.facts.latent_channels, EDGE, EDGE, generator=gen)
        text = {
            "prompt_embeds": torch.randn(BATCH, 8, config.joint_attention_dim, generator=gen),
            "pooled_prompt_embeds": torch.randn(BATCH, config.pooled_projection_dim, generator=gen),
        }
        pred = fam.denoise(model, noisy, torch.rand(BATCH, generator=gen) * 1000, text)
        torch.nn.functional.mse_loss(pred, torch.randn(pred.shape, generator=gen)).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    params_n = sum(p.numel() for p in unwrap(den).parameters())
    result = {"peak_mb": _peak_mb(), "idle_mb": idle_mb, "step_s": sum(times[1:]) / len(times[1:]), "params": params_n}
    Path(out, f"{parallelism}-{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    collectives.close()


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def launch(parallelism: str, model_dir: Path, out: Path) -> list[dict]:
    import torch

    from tuneline.schemas.train import TrainConfig
    from tuneline.stages.train.fsdp import host_memory_env

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # as the trainer's launcher sets it (stages/train/launch.py)
    env |= host_memory_env(TrainConfig(parallelism=parallelism, validate_every=0), torch.device("cpu"), env)
    cmd = [sys.executable, "-m", "tuneline.stages.train.procwatch", "--standalone", "--nproc_per_node=2"]
    cmd += [str(Path(__file__).resolve()), "--worker", parallelism, str(model_dir), str(out)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return [json.loads((out / f"{parallelism}-{r}.json").read_text(encoding="utf-8")) for r in range(2)]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        model_dir = make_model(Path(tmp) / "model")
        got = {p: launch(p, model_dir, Path(tmp)) for p in ("ddp", "fsdp")}
    peak = {p: max(r["peak_mb"] for r in ranks) for p, ranks in got.items()}
    step = {p: max(r["step_s"] for r in ranks) for p, ranks in got.items()}
    print(f"model: flux transformer, {got['ddp'][0]['params'] / 1e6:.0f}M parameters, full fine-tune, 2 processes")
    idle = max(r["idle_mb"] for ranks in got.values() for r in ranks)
    print(f"before loading (interpreter and imports): {idle:.0f} MB per process")
    for p in ("ddp", "fsdp"):
        print(f"{p}: peak RSS per process {peak[p]:.0f} MB, step {step[p]:.3f} s")
    print(f"fsdp_vs_ddp_step_time {step['fsdp'] / step['ddp']:.3f}")
    ratio = peak["fsdp"] / peak["ddp"]
    print(f"RESULT fsdp_vs_ddp_peak_rss {ratio:.3f} goal <= {GOAL} {'PASS' if ratio <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:5])
    else:
        main()
