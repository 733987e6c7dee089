"""Benchmark: the GPU figures, each against its reference in the same command on the same device.

`python bench/gpu.py` on a CUDA machine prints one RESULT line per figure, in the order GPU time should be spent
(FIGURES); the LoRA figures carry their anchor on the same line (bench/gpu_lora.py), and each family's first also
prints plan_vs_measured_<family>. `--only NAME` runs one; `--trace DIR` profiles a few more steps of the LoRA
figures' (and sdxl_lora_step_vs_pure's) loops, and that figure's bare step beside its loop's, a trace each in DIR
and its top ops printed. `--tiny` runs the same
code on the tiny flavors on the CPU (a RESULT line for each figure that can run there, `skipped: NAME (why)` for
the others) and exits 0 whatever the figures are. Without CUDA and without --tiny it prints `no CUDA device:
skipped` and exits 0. Models are random-weight, full size, built from the shipped configs (stages/families/configs);
timings are post-warm-up, caching and validation excluded. On CUDA the
figures run what a user's run does: the base in model.dtype under bf16 autocast, the pinned-memory feed, and the
train stage's torchrun workers in their `cpu:gloo,cuda:nccl` group.
`--compile` trains the timed figures (the LoRA figures, sdxl_lora_step_vs_pure) with train.compile, their RESULT
lines named NAME_compiled. No Prefect: the stages run through their plain runner. bench/README.md lists the wheels
a bare GPU machine needs (bench/gpu_session.sh fetches and installs them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_cache import cache_images_per_s, cache_vs_encoder  # noqa: E402
from gpu_diffusers import DIFFUSERS_SCRIPT, sdxl_lora_step_vs_diffusers  # noqa: E402
from gpu_lora import ANCHORS, lora_figure  # noqa: E402
from gpu_setup import (  # noqa: E402
    Bench,
    caches,
    free,
    median_seconds,
    profile_calls,
    profile_steps,
    result,
    step_seconds,
    worker_threads,
)

from tests.trainer import trainer_for  # noqa: E402

FIGURES = (
    "ddp_two_process_cuda",
    "sdxl_lora",
    "sdxl_lora_step_vs_pure",
    "flux2_klein_lora",
    "flux2_klein_lora_int8",
    "z_image_lora",
    "z_image_lora_ckpt",
    "flux_lora",
    "flux_lora_peak_gib",
    "cache_vs_encoder",
    "cache_images_per_s",
    "sdxl_lora_step_vs_diffusers",
    # Last, alone on the disk: Qwen-Image with its text encoder is ~56 GB, and beside FLUX.1 (~34 GB, which the
    # caching figures build whole for its VAE) or even SDXL it outgrows a GPU machine's 64 GiB disk.
    "qwen_image_lora",
)
NEEDS_CUDA = {
    **{name: "its second value is the peak GPU memory" for name in ANCHORS},
    "flux_lora_peak_gib": "peak GPU memory is a CUDA figure",
    "cache_images_per_s": "1024² VAE throughput is a GPU figure (cache_vs_encoder runs the same code here)",
    "sdxl_lora_step_vs_diffusers": "diffusers' script is measured on the GPU only",
}
# What --tiny cannot reach on the CPU: the branches only a CUDA run takes.
CUDA_BRANCHES = (
    "the nccl half of the cpu:gloo,cuda:nccl group (and the 2-process NCCL check on 2+ GPUs)",
    "the base in model.dtype under bf16 autocast",
    "the pinned-memory feed and its asynchronous copies",
    "block swap's CUDA streams",
    "offloaded activations (gradient_checkpointing: offload) copying to the host",
    "int8 and fp8 bases",
    "peak GPU memory and the memory plan beside it",
    "the latents stage's pinned, non-blocking copies of pixels and latents that overlap the VAE",
    "the lean norms' fused kernels each way (the CPU has no fused RMSNorm backward)",
)
# The full-size models each figure builds in --work (DIR/models/FAMILY).
FAMILIES = {
    **{name: (anchor.family,) for name, anchor in ANCHORS.items()},
    "ddp_two_process_cuda": ("sd15",),
    "sdxl_lora_step_vs_pure": ("sdxl",),
    "flux_lora_peak_gib": ("flux",),
    "cache_vs_encoder": ("sd15", "sdxl"),
    "cache_images_per_s": ("sdxl", "flux"),
    "sdxl_lora_step_vs_diffusers": ("sdxl",),
}


# ---- ddp_two_process_cuda ---------------------------------------------------------------------------------
def ddp_two_process_cuda(b: Bench) -> None:
    """The train stage with 2 torchrun processes against one process replaying both ranks' micro-batches as one
    accumulated step (the same global batch, the same draws): the max abs difference of the trained weights, fp32.
    On 2+ GPUs the ranks talk NCCL, as users' runs do; on one GPU this is the two-ranks-on-one-GPU figure, where
    gloo serves the CUDA tensors (NCCL refuses two ranks on one device)."""
    import torch

    from tuneline.stages.common.stage import StageContext, run_stage
    from tuneline.stages.pipeline import PIPELINE, stage
    from tuneline.stages.train import checkpoint as ckpt
    from tuneline.stages.train.collectives import CUDA_BACKEND_ENV

    steps = 4
    train = {"processes": 2, "steps": steps, "checkpoint_every": steps, "mixed_precision": "no", "seed": 3}
    cfg = b.config("ddp", "sd15", train, model={"dtype": "float32"}, buckets={"resolution": b.resolution("sd15")})
    ctx = caches(cfg)
    shared_gpu = b.device == "cuda" and torch.cuda.device_count() < 2
    if shared_gpu:
        os.environ[CUDA_BACKEND_ENV] = "gloo"
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS in the workers and here
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = run_stage(StageContext(cfg), stage("train"), PIPELINE)[0]
    _, tensors = ckpt.load(out / "checkpoints" / f"step-{steps:07d}")
    two = {n: t.float().cpu() for n, t in tensors["trainable"].items()}
    one, start = replay(cfg, ctx, steps)
    free(b)
    diff = max_abs_difference(two, one)
    # The kernels' own run-to-run difference: the same replay again. On the CPU it is 0; on a GPU, atomics in
    # the convolutions' and attention's backward (in the workers, which ask for no deterministic algorithms, and
    # in memory-efficient attention even here) give what two identical runs differ by, where DDP adds nothing.
    again, _ = replay(cfg, ctx, steps)
    floor = max_abs_difference(again, one)
    print(f"ddp_two_process_cuda: the one-process replay against itself {floor:.3g} (the kernels' run-to-run)")
    # Adam's first steps move each weight by about the learning rate whatever its gradient's size, so a gradient
    # near zero whose sign a GPU kernel's rounding flips moves one weight a whole step: the max abs difference
    # sees that, the difference of the two runs' whole updates (relative to the update) shows how rare it is.
    gap = sum(float((two[n] - w).square().sum()) for n, w in one.items()) ** 0.5
    moved = sum(float((w - start[n]).square().sum()) for n, w in one.items()) ** 0.5
    print(f"ddp_two_process_cuda: |two - one| / |one - start| = {gap / moved:.3g} (the updates' relative difference)")
    backend = "gloo" if shared_gpu or b.device == "cpu" else "nccl"
    print(f"ddp_two_process_cuda: {len(two)} tensors after {steps} steps on {b.device}, {backend}", flush=True)
    result("ddp_two_process_cuda", diff, "<=", 1e-4)


def max_abs_difference(a: dict, b: dict) -> float:
    return max(float((a[n] - w).abs().max()) for n, w in b.items())


def replay(cfg, ctx, steps: int):
    """(trained weights, start weights) of one process replaying both ranks' micro-batches in turn as one
    accumulated step, the loss of each halved (DDP's mean)."""
    from tuneline.stages.train.plan import micro_batches

    one_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"grad_accumulation": 2})})
    trainer = trainer_for(one_cfg, ctx, rank=0, world=2)
    plans = trainer.data.rows.epoch_plans(2)
    streams = [micro_batches(plans, cfg.train.batch_size, r, trainer.position) for r in (0, 1)]
    start = {n: p.detach().float().cpu().clone() for n, p in trainer.params.items()}
    for step in range(steps):
        micro = []
        for r in (0, 1):
            trainer.rank = r  # the rank's seeds: what that worker drew
            micro.append(trainer.prepare(step, next(streams[r])))
        for r, fed in enumerate(micro):
            trainer.rank = r
            trainer.micro_step(fed, sync=True)
        trainer.optimizer_step()
    return {n: p.detach().float().cpu() for n, p in trainer.params.items()}, start


# ---- sdxl_lora_step_vs_pure -------------------------------------------------------------------------------
def bare_step(trainer):
    """The bare step: the same denoiser forward/backward and AdamW on tensors already there."""
    import torch

    dev, fam = trainer.device, trainer.fam
    shape = next(iter(trainer.data.reader.shapes.values()))
    text = {k: v.to(dev) for k, v in trainer.data.text.get([""]).items()}
    x, timesteps = torch.randn(1, *shape, device=dev), torch.tensor([500], device=dev)
    target = torch.randn_like(x)
    amp = trainer.autocast

    def step() -> None:
        with torch.autocast(dev.type, amp, enabled=amp is not None):
            pred = fam.denoise(trainer.denoiser, x, timesteps, text)
        torch.nn.functional.mse_loss(pred.float(), target).backward()
        trainer.opt.step()
        trainer.opt.zero_grad(set_to_none=True)

    return step


def sdxl_lora_step_vs_pure(b: Bench) -> None:
    """Rounds of the loop and the bare step back to back, alternating which goes first; per setting the median of
    the rounds' ratios. One of each in a fixed order read 0.94 and 1.12 on an H200 for the two settings, though the
    loop issues the same ops beyond the bare step's in both (clipping, the loss's weights; counted on the CPU): one
    pair's order and drift moved the ratio more than the loop's own cost."""
    ratios = []
    label, train = b.timed("sdxl_lora_step_vs_pure", {})
    for checkpointing in (False, True):
        cfg = b.config("sdxl-step", "sdxl", {**train, "gradient_checkpointing": checkpointing})
        trainer = trainer_for(cfg, caches(cfg))
        rounds = []
        with worker_threads(trainer):  # both sides at the worker's thread count
            for r in range(b.rounds):
                if r % 2:
                    pure, ours = median_seconds(b, bare_step(trainer)), step_seconds(b, trainer)
                else:
                    ours, pure = step_seconds(b, trainer), median_seconds(b, bare_step(trainer))
                rounds.append((ours, pure))
                print(f"  round {r + 1}: ours {ours:.4f} s/step, bare {pure:.4f} s/step", flush=True)
            traced = f"sdxl_lora_step-checkpointing-{'on' if checkpointing else 'off'}"
            profile_steps(b, trainer, traced)
            profile_calls(b, f"{traced}-bare", bare_step(trainer))  # beside the loop's: where the two steps differ
        ratios.append(statistics.median(ours / pure for ours, pure in rounds))
        print(
            f"sdxl_lora_step gradient_checkpointing={checkpointing}: median of {b.rounds} rounds' ratios "
            f"{ratios[-1]:.3f}",
            flush=True,
        )
        del trainer
        free(b)
    result(label, max(ratios), "<=", 1.1)


# ---- flux_lora_peak_gib -----------------------------------------------------------------------------------
def flux_peak(b: Bench, quantize: str) -> tuple[float, float]:
    """(peak GiB, s/step) of Flux LoRA training steps at 1024², batch 1, gradient checkpointing, quantized base."""
    import torch

    cfg = b.config(f"flux-{quantize}", "flux", {"gradient_checkpointing": True}, model={"quantize": quantize})
    ctx = caches(cfg)  # the text encoders are gone before training starts: the cache holds their output
    torch.cuda.reset_peak_memory_stats()
    trainer = trainer_for(cfg, ctx)
    seconds = step_seconds(b, trainer)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del trainer
    free(b)
    return peak, seconds


def flux_lora_peak_gib(b: Bench) -> None:
    fp8 = flux_peak(b, "fp8")
    print(f"flux_lora fp8: peak {fp8[0]:.2f} GiB, {fp8[1]:.3f} s/step", flush=True)
    peak, seconds = flux_peak(b, "int8")
    print(f"flux_lora int8: peak {peak:.2f} GiB, {seconds:.3f} s/step", flush=True)
    result("flux_lora_peak_gib", peak, "<=", 24)


PLANNED: set[str] = set()  # the families whose plan_vs_measured line is printed
RUN = {
    **{name: lambda b, name=name: lora_figure(b, name, PLANNED) for name in ANCHORS},
    "ddp_two_process_cuda": ddp_two_process_cuda,
    "sdxl_lora_step_vs_pure": sdxl_lora_step_vs_pure,
    "cache_vs_encoder": cache_vs_encoder,
    "cache_images_per_s": cache_images_per_s,
    "flux_lora_peak_gib": flux_lora_peak_gib,
    "sdxl_lora_step_vs_diffusers": sdxl_lora_step_vs_diffusers,
}


def skip_reason(name: str, tiny: bool, examples: Path | None) -> str | None:
    if tiny and name in NEEDS_CUDA:
        return NEEDS_CUDA[name]
    if name == "sdxl_lora_step_vs_diffusers" and not (examples and (examples / DIFFUSERS_SCRIPT).is_file()):
        return f"needs --diffusers-examples DIR holding {DIFFUSERS_SCRIPT}"
    return None


def prune_models(work: Path, later: list[str]) -> None:
    """Remove the full-size models no figure in `later` builds: a run of every figure keeps them all otherwise
    (SDXL, FLUX.2 [klein] with its released-size text encoder, Z-Image, FLUX.1, Qwen-Image: more than a 64 GiB
    disk holds; one such run stopped at `No space left on device`)."""
    import shutil

    keep = {family for name in later for family in FAMILIES[name]}
    for folder in sorted((work / "models").glob("*")):
        if folder.name.removesuffix(".tmp") not in keep:
            shutil.rmtree(folder)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=FIGURES, help="run one figure")
    ap.add_argument("--tiny", action="store_true", help="the tiny flavors on the CPU (the CPU-able figures)")
    ap.add_argument(
        "--diffusers-examples",
        type=Path,
        metavar="DIR",
        help=f"a folder holding diffusers' {DIFFUSERS_SCRIPT} (and in DIR/site what it imports beyond ours)",
    )
    ap.add_argument("--work", type=Path, help="working folder (models, images, workdirs); a temporary one if unset")
    ap.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="profile 3 more steps of the LoRA figures' loops (torch.profiler): a trace each in DIR, top ops printed",
    )
    ap.add_argument(
        "--keep-for",
        nargs="*",
        choices=FIGURES,
        metavar="NAME",
        help="the figures later commands run in this --work (none: no later ones): before each figure, remove the "
        "full-size models that neither it, this command's later figures nor these build",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="train the timed figures (the LoRA figures, sdxl_lora_step_vs_pure) with train.compile: NAME_compiled",
    )
    args = ap.parse_args(argv)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: skipped", flush=True)
        return 0
    if args.tiny:
        torch.set_num_threads(min(2, torch.get_num_threads()))
        print("CUDA branches this CPU run cannot take:", "; ".join(CUDA_BRANCHES), flush=True)
    with tempfile.TemporaryDirectory(prefix="tuneline-gpu-bench-") as tmp:
        examples = args.diffusers_examples and args.diffusers_examples.resolve()  # the script runs in --work
        b = Bench(args.tiny, (args.work or Path(tmp)).resolve(), examples, args.trace, args.compile)
        b.work.mkdir(parents=True, exist_ok=True)
        names = [args.only] if args.only else list(FIGURES)
        why = {name: skip_reason(name, args.tiny, examples) for name in names}
        for i, name in enumerate(names):
            if why[name]:
                print(f"skipped: {name} ({why[name]})", flush=True)
                continue
            later = [n for n in names[i + 1 :] if not why[n]] + (args.keep_for or [])
            if args.keep_for is not None:  # what earlier figures and commands left that no figure to come builds
                prune_models(b.work, [name, *later])
            RUN[name](b)
            free(b)
            if len(names) > 1:  # a one-figure command keeps its models for the next command's (--work)
                prune_models(b.work, later)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
