"""FSDP beside DDP in one torchrun launch (2 gloo processes), for tests/integration/test_fsdp_train.py.

Per cell (a family's tiny flavor, full or LoRA), through the train stage's own worker functions (setup, fit, finish),
each rank records the largest difference of the trained weights after the last step between:

- fsdp_vs_ddp: the run with train.parallelism fsdp and the same run under DDP (both publish final/ for the test);
- fsdp_vs_replay: FSDP and one process replaying both ranks' micro-batches and draws, grad_accumulation doubled;
- resume: FSDP uninterrupted and FSDP resumed from its step-1 checkpoint (must be 0: exact);
- to_one: FSDP and one process that reads the 2-process step-1 checkpoint whole (2 -> 1) and trains on;
- from_one: the replay and 2 FSDP processes resuming the replay's step-1 checkpoint of whole tensors (1 -> 2);
- evals: the held-out eval losses (train.eval) of the DDP run and of the FSDP run, where the cell evaluates;
- eval_share: this rank's held-out batches in the FSDP run and how many of them count (the rest is padding);
- load: what the FSDP run's denoiser held as its shards arrived (tuneline.stages.train.fsdpload.materialize):
  bytes of parameter storage before (the skeleton: adapters only), after (this rank's shards), the bound of this
  rank's shards (torch.chunk's rows, padded) and the whole model's bytes.

Before the cells, every train.optimizer steps a small 2-layer model sharded and whole from the same start and
gradients (30 steps): <root>/optimizers.json holds per optimizer the largest weight difference, whether the
ranks' weights agree and whether it stepped the shards with a fused kernel, or the error.

Usage: python -m tuneline.stages.train.procwatch --standalone --nproc_per_node=2 tests/fsdp_worker.py PLAN.json
PLAN: {"cells": [{"name", "spec" (as the train stage's launcher writes it, parallelism ddp), "out"}]}.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
import typing
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tuneline.schemas.train import TrainConfig
from tuneline.stages.train import collectives, dcp, evaluation, fsdp, fsdpload, worker
from tuneline.stages.train.checkpoint import checkpoint_name
from tuneline.stages.train.loop import Trainer
from tuneline.stages.train.optimizers import build_optimizer
from tuneline.stages.train.plan import Position, micro_batches

LOADS: list[dict] = []  # per sharded load in this process, in order
SHARES: list[dict] = []  # per evaluator built in this process: its batches, and those whose losses count


class RecordingEvaluator(evaluation.Evaluator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        SHARES.append({"batches": len(self.share), "counted": sum(counted for *_, counted in self.share)})


_materialize = fsdpload.materialize


def recording_materialize(den, folder, kept, device) -> None:
    before = storage_bytes(den)
    _materialize(den, folder, kept, device)
    world = torch.distributed.get_world_size()
    rows = [(p.shape[0] if p.dim() else 1, p.numel() * p.element_size()) for p in den.parameters()]
    LOADS.append(
        {
            "before": before,
            "after": storage_bytes(den),
            "bound": sum(-(-n // world) * (b // n) for n, b in rows),
            "whole": sum(b for _, b in rows),
            "adapters": sum(v.numel() * v.element_size() for v in kept["params"].values()),
        }
    )


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of the real storage behind the module's parameters (a shard's local tensor; meta holds none)."""
    held = {}
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if not local.is_meta:
            held[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(held.values())


def probe_optimizers(root: Path) -> None:
    """Every train.optimizer on the same 2-layer model, sharded over the ranks and whole, the same gradients."""
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    found = {}
    for name in typing.get_args(TrainConfig.model_fields["optimizer"].annotation):
        t = TrainConfig(optimizer=name, learning_rate=1.0 if name == "prodigy" else 1e-3)
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 130))
        mod = copy.deepcopy(ref)
        for m in [*mod, mod]:
            fully_shard(m, mesh=mesh)
        try:
            whole_opt, sharded_opt = (
                build_optimizer(list(ref.parameters()), t),
                build_optimizer(list(mod.parameters()), t),
            )
            for step in range(30):
                x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
                for model, opt in ((ref, whole_opt), (mod, sharded_opt)):
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
            got = [p.detach().full_tensor() for p in mod.parameters()]
            diff = max(float((a - b).abs().max()) for a, b in zip(got, ref.parameters()))
            agree = collectives.everyones([g.sum().item() for g in got], 2)
            fused = bool(sharded_opt.param_groups[0].get("fused"))  # torch's AdamW: its kernel on shards
            found[name] = {"diff": diff, "ranks_agree": agree[0] == agree[1], "fused": fused}
        except Exception as err:
            found[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
    if torch.distributed.get_rank() == 0:
        (root / "optimizers.json").write_text(json.dumps(found), encoding="utf-8")


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
    ddp_weights, evals = whole(ddp), {"ddp": run.eval_losses}
    worker.finish(run, ddp)  # final/ as DDP writes it, for the test to compare the FSDP run's with
    sharded = with_train(spec, out / "fsdp", parallelism="fsdp")
    loads, shares = len(LOADS), len(SHARES)
    run, trainer = train(sharded)
    load, share = LOADS[loads], SHARES[shares:]
    evals["fsdp"] = run.eval_losses
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
        "evals": evals,
        "load": load,
        "eval_share": share[0] if share else None,
    }
    return got


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    collectives.init(torch.device("cpu"))
    collectives.init = lambda device: None  # one process group serves every cell (the worker's setup inits it)
    fsdpload.materialize = recording_materialize  # fsdp.shard calls it through the module
    evaluation.Evaluator = RecordingEvaluator  # the worker's fit builds it through the module
    probe_optimizers(Path(plan_path).parent)
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
