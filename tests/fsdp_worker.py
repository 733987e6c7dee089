"""FSDP beside DDP in one torchrun launch (2 gloo processes), for tests/integration/test_fsdp_train.py.

Per cell (a family's tiny flavor, full or LoRA), through the train stage's own worker functions (setup, fit, finish),
each rank records the largest difference of the trained weights after the last step between:

- fsdp_vs_ddp: the run with train.parallelism fsdp and the same run under DDP (both publish final/ for the test);
- fsdp_vs_replay: FSDP and one process replaying both ranks' micro-batches and draws, grad_accumulation doubled;
- resume: FSDP uninterrupted and FSDP resumed from its step-1 checkpoint (must be 0: exact);
- to_one: FSDP and one process that reads the 2-process step-1 checkpoint whole (2 -> 1) and trains on;
- from_one: the replay and 2 FSDP processes resuming the replay's step-1 checkpoint of whole tensors (1 -> 2).

Usage: python -m tuneline.stages.train.procwatch --standalone --nproc_per_node=2 tests/fsdp_worker.py PLAN.json
PLAN: {"cells": [{"name", "spec" (as the train stage's launcher writes it, parallelism ddp), "out"}]}.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

from tuneline.stages.train import collectives, dcp, fsdp, worker
from tuneline.stages.train.checkpoint import checkpoint_name
from tuneline.stages.train.loop import Trainer
from tuneline.stages.train.plan import Position, micro_batches


def whole(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: fsdp.full(p).clone() for n, p in trainer.params.items()}  # a collective for sharded parameters


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


def with_train(spec: dict, out: Path, **train) -> dict:
    config = json.loads(json.dumps(spec["config"]))
    config["train"].update(train)
    return spec | {"config": config, "out_dir": str(out)}


def train(spec: dict) -> tuple[worker.Run, Trainer]:
    Path(spec["out_dir"]).mkdir(parents=True, exist_ok=True)
    run = worker.setup(spec)
    return run, worker.fit(run)


def replay(spec: dict, resume: Path | None, save_after: int | None) -> tuple[Trainer, dict[str, torch.Tensor]]:
    """One process (on each rank alike, no collective per step): the 2-process run's micro-batches and draws of
    every rank, grad_accumulation doubled, from `resume` (read whole) or the start; its checkpoint after step
    `save_after` goes to <out_dir>/checkpoints, written whole as one process writes it."""
    run = worker.setup(spec)
    t, world = run.cfg.train, run.world
    cfg = run.cfg.model_copy(
        update={"train": t.model_copy(update={"grad_accumulation": t.grad_accumulation * world, "parallelism": "ddp"})}
    )
    trainer = Trainer(cfg, run.family, run.model_dir, run.data, 0, 1, run.device, resume)
    start = Position(**json.loads((resume / "state.json").read_text())["position"]) if resume else Position()
    streams = [micro_batches(run.data.rows.epoch_plans(world), t.batch_size, r, start) for r in range(world)]
    while trainer.step < t.steps:
        for rank, stream in enumerate(streams):
            trainer.rank = rank  # the seeds of this rank's draws (tuneline.stages.train.plan)
            for m in range(t.grad_accumulation):
                mb = next(stream)
                trainer.micro_step(trainer.prepare(trainer.step * t.grad_accumulation + m, mb), sync=True)
        trainer.position = mb.after
        trainer.optimizer_step()
        if trainer.step == save_after:
            tensors, state = trainer.checkpoint()
            # its position walks the 2-process plan: recorded in that plan's units
            state |= {"world_size": world, "grad_accumulation": t.grad_accumulation}
            dcp.save(Path(spec["out_dir"]) / "checkpoints", trainer.step, tensors, state, rank=run.rank)
    return trainer, whole(trainer)


def run_cell(cell: dict) -> dict:
    out, spec = Path(cell["out"]), cell["spec"]
    # The live weights after the last step, taken before finish() puts the EMA's in for final/.
    run, ddp = train(with_train(spec, out / "ddp"))
    ddp_weights = whole(ddp)
    worker.finish(run, ddp)  # final/ as DDP writes it, for the test to compare the FSDP run's with
    sharded = with_train(spec, out / "fsdp", parallelism="fsdp")
    run, trainer = train(sharded)
    weights = whole(trainer)
    worker.finish(run, trainer)
    first = out / "fsdp" / "checkpoints" / checkpoint_name(1)
    _, resumed = train(with_train(sharded, out / "resumed") | {"resume": str(first)})
    _, to_one = replay(with_train(spec, out / "to-one"), first, None)
    reference, reference_weights = replay(with_train(spec, out / "replay"), None, save_after=1)
    from_replay = out / "replay" / "checkpoints" / checkpoint_name(1)
    _, from_one = train(with_train(sharded, out / "from-one") | {"resume": str(from_replay)})
    got = {
        "fsdp_vs_ddp": max_diff(weights, ddp_weights),
        "fsdp_vs_replay": max_diff(weights, reference_weights),
        "resume": max_diff(weights, whole(resumed)),
        "to_one": max_diff(weights, to_one),
        "from_one": max_diff(reference_weights, whole(from_one)),
        "sharded": all(fsdp.is_sharded(p) for p in trainer.params.values()),
    }
    return got


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    collectives.init(torch.device("cpu"))
    collectives.init = lambda device: None  # one process group serves every cell (the worker's setup inits it)
    rank = torch.distributed.get_rank()
    for cell in plan["cells"]:
        Path(cell["out"]).mkdir(parents=True, exist_ok=True)
        try:
            got = run_cell(cell)
        except Exception as err:  # the cell's failure is its result; the next cell still runs
            got = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            print(f"cell {cell['name']} rank {rank}: {got['error']}", file=sys.stderr, flush=True)
        (Path(cell["out"]) / f"rank-{rank}.json").write_text(json.dumps(got), encoding="utf-8")
    collectives.close()


if __name__ == "__main__":
    main(sys.argv[1])
