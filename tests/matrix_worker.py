"""The training matrix's worker: started by torchrun (2 gloo processes), it trains every cell through the train
stage's own worker functions (tuneline.stages.train.worker: setup, fit, finish), one cell after another in one
process group, DDP and FSDP cells alike, and records per rank what tests/integration/test_training_matrix.py asserts:

- grads: per optimizer step, each trainable parameter's gradient as the optimizer is about to see it (after DDP's
  reduction, or FSDP's reduce-scatter: judged on the whole gradient gathered from the shards): "none" (the
  reducer never got it), "nonfinite", "zero" or "ok";
- replay: rank 0's largest difference between the 2-process weights after the last step (gathered whole under
  FSDP) and a 1-process DDP replay of the same global batch (each rank's micro-batches with that rank's draws, the
  loss scaled by 1 / (ranks x accumulation) as DDP's averaging does). An FSDP cell and its DDP twin differ only
  in train.parallelism, which the replay sets to ddp: their replays are the same computation, run once for both
  (the plan's `replay` key names the twin);
- resume: the largest difference between the uninterrupted weights and a run resumed from the step-1 checkpoint;
- sharded: whether every trained parameter was a DTensor shard (FSDP);
- controls: per micro-batch, whether it carried control latents (the edit families train with their controls);
- error: the exception that stopped the cell, if any (a DDP error at step 2 is one).

Usage: python -m tuneline.stages.train.procwatch --standalone --nproc_per_node=2 tests/matrix_worker.py PLAN.json
PLAN: {"cells": [{"name", "spec" (as the train stage's launcher writes it), "out", "replay"}]}; writes
<out>/rank-<r>.json.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tuneline.stages.train import collectives, fsdp, worker
from tuneline.stages.train.checkpoint import checkpoint_name
from tuneline.stages.train.loop import Trainer
from tuneline.stages.train.plan import Position, micro_batches

TRAINED = "trained.safetensors"  # rank 0's trained parameters after the last step, by name
REPLAYS: dict[str, dict[str, torch.Tensor]] = {}  # rank 0: replay key -> weights, while a later cell still needs them


class RecordingTrainer(Trainer):
    """The worker's Trainer, noting every trainable parameter's gradient before each optimizer step."""

    latest: RecordingTrainer | None = None  # the last one built: a cell that fails still reports its gradients

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grad_states: list[dict[str, str]] = []
        self.controls: list[bool] = []
        RecordingTrainer.latest = self

    def prepare(self, index, mb):
        fed = super().prepare(index, mb)
        self.controls.append("control_latents" in fed.cond)
        return fed

    def optimizer_step(self) -> None:
        # every rank gathers the same gradients in the same order (a collective for FSDP's shards)
        self.grad_states.append({n: grad_state(p.grad) for n, p in self.params.items()})
        super().optimizer_step()


def grad_state(g: torch.Tensor | None) -> str:
    if g is None:
        return "none"
    g = fsdp.full(g)
    if not torch.isfinite(g).all():
        return "nonfinite"
    return "ok" if bool(g.abs().sum() > 0) else "zero"


def whole(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters' whole values (gathered from FSDP's shards: every rank must call it)."""
    return {n: fsdp.full(p).clone() for n, p in params.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n].detach().float() - b[n].detach().float()).abs().max()) for n in a)


def replay(spec: dict, world: int) -> dict[str, torch.Tensor]:
    """One process, unsharded, no DDP: every rank's micro-batches of every step with that rank's draws,
    accumulated."""
    run = worker.setup(spec)
    t = run.cfg.train
    one = {"grad_accumulation": t.grad_accumulation * world, "parallelism": "ddp"}
    cfg = run.cfg.model_copy(update={"train": t.model_copy(update=one)})
    trainer = Trainer(cfg, run.family, run.model_dir, run.data, 0, 1, run.device)
    streams = [micro_batches(run.data.rows.epoch_plans(world), t.batch_size, r, Position()) for r in range(world)]
    for step in range(t.steps):
        for rank, stream in enumerate(streams):
            trainer.rank = rank  # the seeds of this rank's draws (tuneline.stages.train.plan)
            for m in range(t.grad_accumulation):
                trainer.micro_step(trainer.prepare(step * t.grad_accumulation + m, next(stream)), sync=True)
        trainer.optimizer_step()
    return trainer.params


def shared_replay(cell: dict, spec: dict, world: int, users: Counter) -> dict[str, torch.Tensor]:
    """The cell's replay: computed by the first cell of its `replay` key, kept for the later ones (`users`: the
    plan's cells of each key after this one)."""
    key = cell["replay"]
    weights = REPLAYS.pop(key, None)
    if weights is None:
        weights = {n: p.detach().clone() for n, p in replay(spec, world).items()}
    if users[key] > 0:
        REPLAYS[key] = weights
    return weights


def run_cell(cell: dict, users: Counter) -> dict:
    """Train, export, resume and replay one cell. What only rank 0 does (exports, replay) can fail on rank 0 alone:
    its failure is recorded and rank 0 still meets the others at the barriers they wait at, so the ranks stay in
    step for the next cell."""
    spec = cell["spec"]
    run = worker.setup(spec)
    trainer = worker.fit(run)  # its failures (DDP's, a non-finite loss) happen on every rank alike
    got: dict = {"grads": trainer.grad_states, "controls": trainer.controls}
    got["sharded"] = all(fsdp.is_sharded(p) for p in trainer.params.values())
    weights = whole(trainer.params)  # the live weights, before finish() puts the EMA's in for final/
    try:
        worker.finish(run, trainer)  # rank 0 exports, then two barriers
    except Exception as err:
        got["error"] = f"exports: {type(err).__name__}: {err}"
        collectives.barrier(run.world)
        collectives.barrier(run.world)
    if run.rank == 0:  # what the exports must hold
        save_file({n: p.contiguous() for n, p in weights.items()}, Path(cell["out"]) / TRAINED)
    first = Path(spec["out_dir"]) / "checkpoints" / checkpoint_name(1)
    again = worker.fit(worker.setup(spec | {"resume": str(first), "out_dir": str(Path(cell["out"]) / "resumed")}))
    got["resume"] = max_diff(weights, whole(again.params))
    if run.rank == 0:
        try:
            got["replay"] = max_diff(weights, shared_replay(cell, spec, run.world, users))
        except Exception as err:
            got["error"] = f"1-process replay: {type(err).__name__}: {err}"
    collectives.barrier(run.world)
    return got


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    # The train stage's backend; a rank stuck in a collective ends the launch in minutes, not the stage's 30.
    dist.init_process_group(collectives.backend(torch.device("cpu")), timeout=timedelta(minutes=5))
    collectives.init = lambda device: None  # one process group serves every cell (the worker's setup inits it)
    worker.Trainer = RecordingTrainer
    rank = dist.get_rank()
    users = Counter(cell["replay"] for cell in plan["cells"])
    for cell in plan["cells"]:
        Path(cell["out"]).mkdir(parents=True, exist_ok=True)
        Path(cell["spec"]["out_dir"]).mkdir(parents=True, exist_ok=True)
        RecordingTrainer.latest = None
        users[cell["replay"]] -= 1
        try:
            got = run_cell(cell, users)
        except Exception as err:  # the cell's failure is its result; the next cell still runs
            got = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            got["grads"] = RecordingTrainer.latest.grad_states if RecordingTrainer.latest else []
            print(f"cell {cell['name']} rank {rank}: {got['error']}", file=sys.stderr, flush=True)
        (Path(cell["out"]) / f"rank-{rank}.json").write_text(json.dumps(got), encoding="utf-8")
    collectives.close()


if __name__ == "__main__":
    main(sys.argv[1])
