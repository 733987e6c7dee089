"""The training workers' collectives under the process group a CUDA run builds, and every collective of a real
2-process training recorded: legal on every backend, one all-reduce of ours per step.

No GPU is needed: `cpu:gloo,cuda:nccl` with nccl swapped for gloo (TUNELINE_CUDA_BACKEND=gloo) is the group a CUDA
run builds with gloo standing in for NCCL. A group with no CPU backend (NCCL's, or `cuda:gloo`) refuses every CPU
collective ("No backend type associated with device type cpu"), as a CUDA run's workers did.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.integration.test_train_support import small_config, train
from tuneline.stages.train import collectives
from tuneline.stages.train.stopping import StopSignals

RECORD_ENV = "TUNELINE_TEST_COLLECTIVES"

# Loaded by every Python process the training starts (PYTHONPATH): in each torchrun worker (RANK set) it wraps the
# public collectives of torch.distributed and appends one line per call: the op, its tensors' device types, the
# group's backends. DDP's gradient reduction runs in C++ and is not seen (it is not ours to count).
SITECUSTOMIZE = """
import os
if os.environ.get("%(env)s") and os.environ.get("RANK") is not None:
    import json
    import torch
    import torch.distributed as dist

    _out = os.path.join(os.environ["%(env)s"], "rank%%s.jsonl" %% os.environ["RANK"])

    def _tensors(values):
        for v in values:
            if isinstance(v, torch.Tensor):
                yield v
            elif isinstance(v, (list, tuple)):
                yield from _tensors(v)

    def _wrap(name, fn):
        def recorded(*args, **kwargs):
            devices = sorted({t.device.type for t in _tensors(list(args) + list(kwargs.values()))})
            with open(_out, "a") as f:
                f.write(json.dumps({"op": name, "devices": devices, "backends": dist.get_backend_config()}) + "\\n")
            return fn(*args, **kwargs)
        return recorded

    for _name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
                  "all_reduce_coalesced", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
                  "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
                  "scatter_object_list", "send", "recv", "_broadcast_coalesced", "_verify_params_across_processes"):
        if hasattr(dist, _name):
            setattr(dist, _name, _wrap(_name, getattr(dist, _name)))
""" % {"env": RECORD_ENV}  # noqa: UP031 (the code's own braces stay literal)

TRAIN = {
    "steps": 4,
    "checkpoint_every": 2,
    "batch_size": 2,
    "grad_accumulation": 1,
    "processes": 2,
    "keep_checkpoints": 2,
    "mode": "lora",
    "ema": False,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    """One rank: the helpers a training worker calls, under the group collectives.backend picks for CUDA."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            collectives.CUDA_BACKEND_ENV: "gloo",
        }
    )
    collectives.init(torch.device("cuda"))
    got: dict = {"backend": dist.get_backend_config()}
    try:
        # Stop/checkpoint agreement and loss gather: one all-reduce; only rank 1 saw SIGTERM, both stop.
        losses, flags = collectives.exchange(torch.tensor([0.5 + rank, 2.0 * rank]), [float(rank == 1), 0.0], rank, 2)
        got["losses"], got["decision"] = losses.tolist(), StopSignals.decide(flags)
        got["resume"] = collectives.everyones(f"step-{rank}", 2)  # the resume agreement
        collectives.barrier(2)
        # DDP over a frozen quantized base (int8, and fp8's weight-only tensors, which torchao also builds on a
        # CPU): only the trainables take part (rank 0's broadcast, averaged gradients), the base is never sent.
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        for kind, config in (("int8", Int8WeightOnlyConfig()), ("fp8", Float8WeightOnlyConfig())):
            torch.manual_seed(rank)  # different on each rank: the wrap must make the trainables rank 0's
            frozen = torch.nn.Linear(8, 8).requires_grad_(False)
            quantize_(frozen, config)
            model = torch.nn.Sequential(frozen, torch.nn.Linear(8, 1))
            params = {n: p for n, p in model.named_parameters() if p.requires_grad}
            ddp = collectives.wrap(model, params, torch.device("cpu"))
            weights = params["1.weight"].detach().flatten().tolist()
            ddp(torch.full((1, 8), float(rank + 1))).sum().backward()
            got[kind] = {
                "weights": weights,
                "grad": params["1.weight"].grad.flatten().tolist(),
                "base": type(frozen.weight).__name__,
            }
        collectives.barrier(2)  # neither rank tears its group down while the other still uses it
    finally:
        collectives.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))


def test_helpers_run_under_the_backend_a_cuda_run_builds(tmp_path):
    mp.start_processes(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["backend"] == "cpu:gloo,cuda:gloo"
    assert r0["losses"] == r1["losses"] == [[0.5, 0.0], [1.5, 2.0]]
    assert r0["decision"] == r1["decision"] == [True, True], "a stop on one rank stops (and checkpoints) every rank"
    assert r0["resume"] == r1["resume"] == ["step-0", "step-1"]
    for kind, base in (("int8", "Int8"), ("fp8", "Float8")):
        assert base in r0[kind]["base"]
        assert r0[kind]["weights"] == r1[kind]["weights"], f"{kind}: the trainables are rank 0's on every rank"
        assert r0[kind]["grad"] == r1[kind]["grad"], f"{kind}: the gradients are averaged over the ranks"


def test_backend_per_device_and_the_test_switch(monkeypatch):
    monkeypatch.delenv(collectives.CUDA_BACKEND_ENV, raising=False)
    assert collectives.backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert collectives.backend(torch.device("cpu")) == "gloo"
    monkeypatch.setenv(collectives.CUDA_BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match=collectives.CUDA_BACKEND_ENV):
        collectives.backend(torch.device("cuda", 0))


def _recorded(folder: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


def _final(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next((path / "final").rglob("*.safetensors"))))


@pytest.mark.ddp(reason="every collective of a real 2-process training")
def test_int8_base_trains_on_two_processes_with_one_collective_per_step_and_resumes(
    tmp_path, monkeypatch, upstream_store, demo_data
):
    """A real 2-process LoRA training on an int8 base, every collective recorded; then the run continued from its
    step-2 checkpoint reaches the same weights."""
    site, record = tmp_path / "site", tmp_path / "record"
    site.mkdir(), record.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv(RECORD_ENV, str(record))
    wd = tmp_path / "wd"
    quantized = {"device": "cpu", "quantize": "int8"}
    upstream_store.upstream(small_config(wd, TRAIN, model=quantized, dataset={"path": str(demo_data)}))
    whole = train(small_config(wd, TRAIN, model=quantized, dataset={"path": str(demo_data)}))
    steps, device = TRAIN["steps"], "cpu"  # the training device
    every = small_config(wd, TRAIN, model=quantized, dataset={"path": str(demo_data)}).train.effective_validate_every()
    renders = steps // every if every else 0  # in-training validation gathers each rank's images once
    assert renders, "the demo's in-training validation is on: its gather is one of the recorded collectives"
    for rank in (0, 1):
        calls = _recorded(record, rank)
        assert [c["op"] for c in calls] == ["all_gather_object", "broadcast"] + ["all_reduce"] * steps + [
            "all_gather_object"
        ] * renders + ["barrier", "barrier"], f"rank {rank}: {calls}"
        for c in calls:
            legal = all(d == device or (d == "cpu" and "cpu:" in c["backends"]) for d in c["devices"])
            assert legal and (c["devices"] or "cpu:" in c["backends"]), f"rank {rank}: {c} has no backend serving it"
    monkeypatch.delenv(RECORD_ENV)

    # Resume: the published run removed (or the rerun would reuse it), its step-2 checkpoint continued.
    want = _final(whole)
    ckpt = tmp_path / "step-0000002"
    shutil.copytree(whole / "checkpoints" / "step-0000002", ckpt)
    shutil.rmtree(whole)
    resumed = train(small_config(wd, TRAIN | {"resume": str(ckpt)}, model=quantized, dataset={"path": str(demo_data)}))
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert manifest["resumed_from"] == str(ckpt) and manifest["world_size"] == 2 and manifest["step"] == steps
    got = _final(resumed)
    assert want.keys() == got.keys() and want
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
