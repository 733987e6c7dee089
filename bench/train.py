"""Benchmark: the training loop against the pure forward/backward/optimizer step, in one run.

The loop is the real one (tuneline.stages.train.loop.Trainer on the demo's caches, one process): plan walking, cached
latents sampled per micro-batch, caption dropout over the text cache, noise and timesteps, min-SNR weighting,
the loss check, clipping, the learning-rate schedule. The reference runs the same denoiser call, MSE,
backward and AdamW step on tensors already in memory, with the same bucket shapes in the same order. Each round
times both back to back (alternating which goes first); on a shared, noisy machine the median of the per-round
ratios counts, with the best round of each printed too. The ratio is samples/s of the loop over samples/s of the
reference.
"""

from __future__ import annotations

import copy
import logging
import statistics
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.trainer import trainer_for  # noqa: E402
from tuneline.schemas.config import parse_config  # noqa: E402
from tuneline.schemas.demo import DEMO_CONFIG  # noqa: E402
from tuneline.stages.common.stage import StageContext, run_stage  # noqa: E402
from tuneline.stages.pipeline import PIPELINE, stage  # noqa: E402
from tuneline.stages.scan.demo import write_demo_dataset  # noqa: E402
from tuneline.stages.train.loop import Data, Trainer  # noqa: E402
from tuneline.stages.train.plan import micro_batches  # noqa: E402

STEPS = 30  # per round
ROUNDS = 6
GOAL = 0.9


def caches(workdir: Path) -> StageContext:
    """The demo's scan/latents/text artifacts, built once."""
    data = copy.deepcopy(DEMO_CONFIG) | {"workdir": str(workdir)}
    cfg = parse_config(data)
    write_demo_dataset(cfg.resolve(cfg.dataset.path))
    ctx = StageContext(cfg)
    for name in ("scan", "latents", "text"):
        run_stage(ctx, stage(name), PIPELINE)
    return ctx


def time_loop(trainer: Trainer, stream, steps: int) -> tuple[float, list[str]]:
    """Seconds for `steps` optimizer steps of the real loop (its feed reading ahead in its thread, as the worker
    runs it), and the buckets it used."""
    buckets = []
    start = time.perf_counter()
    with closing(trainer.feed(stream)) as feed:
        for _ in range(steps):
            micro = [next(feed) for _ in range(trainer.t.grad_accumulation)]
            buckets += [fed.mb.bucket for fed in micro]
            trainer.train_step(micro)
    return time.perf_counter() - start, buckets


def time_pure(trainer: Trainer, tensors: dict[str, tuple], buckets: list[str]) -> float:
    """Seconds for the same micro-batches as plain forward/backward/step on in-memory tensors."""
    model, opt, fam = trainer.model, trainer.opt, trainer.fam
    accum = trainer.t.grad_accumulation
    start = time.perf_counter()
    for i, bucket in enumerate(buckets):
        noisy, t, text, target = tensors[bucket]
        pred = fam.denoise(model, noisy, t, text)
        (torch.nn.functional.mse_loss(pred, target) / accum).backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def one_round(trainer: Trainer, plan_of, tensors: dict[str, tuple], pure_first: bool) -> tuple[float, float]:
    """(loop seconds, pure seconds) for the same micro-batches: the pure pass replays the loop's bucket order,
    read ahead from the plan at the trainer's position (walking the plan is cheap and deterministic)."""
    t = trainer.t
    ahead = micro_batches(plan_of, t.batch_size, 0, trainer.position)
    buckets = [next(ahead).bucket for _ in range(STEPS * t.grad_accumulation)]
    pure_s = time_pure(trainer, tensors, buckets) if pure_first else 0.0
    loop_s, trained = time_loop(trainer, micro_batches(plan_of, t.batch_size, 0, trainer.position), STEPS)
    assert trained == buckets
    return loop_s, pure_s if pure_first else time_pure(trainer, tensors, buckets)


def in_memory(data: Data, batch: int) -> dict[str, tuple]:
    """Random tensors of each bucket's batch shapes (latents, timesteps, text, target)."""
    text = {k: v[:1].expand(batch, *v.shape[1:]).float().clone() for k, v in data.text.get([""]).items()}
    out = {}
    for bucket, shape in data.reader.shapes.items():
        x = torch.randn(batch, *shape)
        out[bucket] = (x, torch.randint(0, 1000, (batch,)), text, torch.randn_like(x))
    return out


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # as a training process runs (train.threads_per_process)
    with tempfile.TemporaryDirectory(prefix="tuneline-bench-train-") as tmp:
        ctx = caches(Path(tmp))
        cfg = ctx.cfg
        t = cfg.train
        trainer = trainer_for(cfg, ctx)  # one process, reading the caches as the worker does
        data = trainer.data

        def plan_of(epoch: int):
            return data.reader.plan(t.batch_size, 1, t.seed, epoch)

        tensors = in_memory(data, t.batch_size)
        time_loop(trainer, micro_batches(plan_of, t.batch_size, 0), 5)  # warm-up: allocations, block reads
        loops, pures = [], []
        for r in range(ROUNDS):
            loop_s, pure_s = one_round(trainer, plan_of, tensors, pure_first=r % 2 == 1)
            loops.append(loop_s)
            pures.append(pure_s)
            print(
                f"round {r + 1}: loop {loop_s:.2f} s, pure {pure_s:.2f} s for {STEPS * t.grad_accumulation} "
                f"micro-batches of {t.batch_size}",
                flush=True,
            )
        samples = STEPS * t.grad_accumulation * t.batch_size
        print(
            f"best rounds: training loop {samples / min(loops):.1f} samples/s, pure forward/backward/step "
            f"{samples / min(pures):.1f} samples/s"
        )
        ratio = statistics.median(p / lp for lp, p in zip(loops, pures))
        print(f"RESULT train_loop_ratio {ratio:.3f} goal >= {GOAL} {'PASS' if ratio >= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
