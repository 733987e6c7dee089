"""The LoRA figures of bench/gpu.py, each beside its published anchor (SimpleTuner's H100 sweep: bf16, batch 1,
1024², post-warm-up, caching and validation excluded), with the memory plan beside the measured peak, and the
quantized bases' learning check. Every figure here needs CUDA: its second value is the peak GPU memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_setup import Bench, caches, free, profile_steps, result, step_seconds

from tests.trainer import trainer_for

GB = 1e9 / 2**30  # GiB per GB: the FLUX.2 [klein] figures are published in GB


@dataclass(frozen=True)
class Anchor:
    family: str
    seconds: float | None  # the anchor's s/step (None: only a memory figure is published)
    gib: float  # the anchor's peak
    train: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)


ANCHORS = {
    "sdxl_lora": Anchor("sdxl", 0.606, 13.0),
    # FLUX.2 [klein] 4 B's ~12 GB (bf16) and ~8 GB (int8) leave about 4 GB beside its weights (7.2 GiB in bf16): a
    # checkpointed step's room (planned 0.7 GiB of activations at 1024²), not an eager one's (14 GiB; measured
    # 22.0 GiB whole in bf16, 18.4 over int8, on an H100, 2026-11-26).
    "flux2_klein_lora": Anchor("flux2_klein", None, 12 * GB, {"gradient_checkpointing": True}),
    "flux2_klein_lora_int8": Anchor(
        "flux2_klein", None, 8 * GB, {"gradient_checkpointing": True}, model={"quantize": "int8"}
    ),
    "z_image_lora": Anchor("z_image", 0.243, 21.3),
    "z_image_lora_ckpt": Anchor("z_image", 0.479, 12.9, {"gradient_checkpointing": True}),
    # FLUX.1 (12 B) against Chroma's 8.9 B figures (0.454 s, 26.2 GiB) scaled by the parameter count.
    "flux_lora": Anchor("flux", 0.61, 35.0),
    "qwen_image_lora": Anchor("qwen_image", 1.202, 41.0, {"gradient_checkpointing": True}),
}
PLAN_TOLERANCE = 0.15
LEARN_STEPS = 20


def stage_peak(b: Bench, cfg) -> int | None:
    """The user's path: the train stage as `tuneline run` starts it (torchrun, the `cpu:gloo,cuda:nccl` group,
    world 1) for the warm-up and timed steps; the peak bytes its worker records (None on the CPU)."""
    from tuneline.schemas.train_manifest import TrainManifest
    from tuneline.stages.common.stage import StageContext, run_stage
    from tuneline.stages.pipeline import PIPELINE, stage

    steps = b.warmup + b.steps
    ctx = StageContext(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": steps})}))
    out = run_stage(ctx, stage("train"), PIPELINE)[0]
    return ctx.store.read(out, TrainManifest).peak_memory


def measured(b: Bench, name: str, anchor: Anchor, planned_families: set[str]) -> tuple[float, float]:
    """(s/step, peak GiB) of the LoRA step at the anchor's settings: the peak of the train stage's own run (the
    user's path), the s/step of the same Trainer in this process (the stage records no step times). The first
    figure of a family also prints plan_vs_measured_<family> (the plan against the in-process peak)."""
    from tuneline.stages.families import resolve as models
    from tuneline.stages.train.memcheck import gpu_figures

    cfg = b.config(name, anchor.family, b.timed(name, anchor.train)[1], model=anchor.model)
    ctx = caches(cfg)
    seconds = []
    trainers = []

    def timed() -> None:
        trainer = trainer_for(cfg, ctx)
        trainers.append(trainer)
        seconds.append(step_seconds(b, trainer))

    fig = gpu_figures(cfg, models.model_dir(ctx), timed)
    profile_steps(b, trainers.pop(), name)  # after the peak's steps: the profiler's own memory is not the step's
    free(b)
    peak = stage_peak(b, cfg)
    if anchor.family not in planned_families:
        planned_families.add(anchor.family)
        off = abs(fig["planned"] / fig["measured"] - 1)
        result(
            b.timed(f"plan_vs_measured_{anchor.family}", {})[0],  # a compiled step's peak is its own figure
            off,
            "<=",
            PLAN_TOLERANCE,
            planned_gib=fig["planned"] / 2**30,
            measured_gib=fig["measured"] / 2**30,
        )
    return seconds[0], peak / 2**30


def loss_falls(b: Bench, family: str, quantize: str) -> tuple[float, float]:
    """(first, mean of the last 5) losses of LEARN_STEPS steps on one fixed batch (the same draws every step)
    over a `quantize` base: the adapter learns through the quantized weights."""
    from tuneline.stages.train.plan import micro_batches

    cfg = b.config(f"learn-{quantize}", family, model={"quantize": quantize})
    trainer = trainer_for(cfg, caches(cfg))
    mb = next(micro_batches(trainer.data.rows.epoch_plans(1), cfg.train.batch_size, 0))
    losses = [trainer.train_step([trainer.prepare(0, mb)]) for _ in range(LEARN_STEPS)]
    del trainer
    free(b)
    return losses[0], sum(losses[-5:]) / 5


def lora_figure(b: Bench, name: str, planned_families: set[str]) -> None:
    anchor = ANCHORS[name]
    seconds, peak = measured(b, name, anchor, planned_families)
    print(f"{name}: {seconds:.4f} s/step, peak {peak:.2f} GiB on {b.device}", flush=True)
    if anchor.model.get("quantize"):
        for quantize in ("int8", "fp8"):
            first, last = loss_falls(b, anchor.family, quantize)
            print(f"{name}: {quantize} base, loss over {LEARN_STEPS} steps {first:.4f} -> {last:.4f}", flush=True)
            if not last < first:
                peak = float("inf")  # a base the adapter cannot learn through fails the figure
    label = b.timed(name, {})[0]
    if anchor.seconds is None:
        result(label, peak, "<=", anchor.gib, s_per_step=seconds)
    else:
        ok = peak <= anchor.gib
        result(label, seconds, "<=", anchor.seconds, also=ok, peak_gib=peak, anchor_peak_gib=anchor.gib)
