"""Checkpoint files: atomic layout, exact optimizer round trip, keep-last-K, verification, resume targets."""

from __future__ import annotations

import json

import pytest
import torch

from tuneline.stages.train import checkpoint as ckpt


def _trained_optimizer(seed: int = 0) -> tuple[dict[str, torch.nn.Parameter], torch.optim.AdamW]:
    torch.manual_seed(seed)
    params = {"a.weight": torch.nn.Parameter(torch.randn(3, 2)), "b.bias": torch.nn.Parameter(torch.randn(4))}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        loss = sum((p**2).sum() for p in params.values())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return params, opt


def test_optimizer_state_round_trips_exactly(tmp_path):
    params, opt = _trained_optimizer()
    names = list(params)
    tensors, meta = ckpt.optimizer_tensors(opt, names)
    path = ckpt.save(tmp_path, 3, {"optimizer": tensors}, {"optimizer": meta})
    state, loaded = ckpt.load(path)
    fresh = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    opt2 = torch.optim.AdamW(list(fresh.values()), lr=1.0)
    ckpt.restore_optimizer(opt2, names, loaded["optimizer"], state["optimizer"])
    for o in (opt, opt2):  # one more identical step from identical states must agree bit for bit
        for p in o.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        o.step()
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        assert torch.equal(p, q)
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_layout_is_safetensors_plus_json_written_atomically(tmp_path):
    path = ckpt.save(tmp_path, 7, {"trainable": {"w": torch.ones(2)}}, {"position": {"epoch": 0, "index": 3}})
    assert path.name == "step-0000007"
    assert sorted(p.name for p in path.iterdir()) == ["state.json", "trainable.safetensors"]
    state = json.loads((path / "state.json").read_text())
    assert state["step"] == 7 and set(state["files"]) == {"trainable.safetensors"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_keep_last_k_and_latest(tmp_path):
    for step in (2, 4, 6, 8):
        ckpt.save(tmp_path, step, {"trainable": {"w": torch.full((1,), float(step))}}, {})
        ckpt.prune(tmp_path, 2)
    assert [s for s, _ in ckpt.listed(tmp_path)] == [6, 8]
    (tmp_path / ".step-0000010.tmp").mkdir()  # a checkpoint killed mid-write is not a checkpoint
    assert ckpt.resolve("latest", tmp_path, tmp_path).name == "step-0000008"


def test_corrupt_checkpoint_is_refused_naming_the_file(tmp_path):
    path = ckpt.save(tmp_path, 1, {"trainable": {"w": torch.ones(8)}}, {})
    data = bytearray((path / "trainable.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "trainable.safetensors").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="trainable.safetensors"):
        ckpt.load(path)


def test_missing_resume_target_is_an_error_never_a_fresh_start(tmp_path):
    assert ckpt.resolve(None, tmp_path / "checkpoints", tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match="latest.*no checkpoint"):
        ckpt.resolve("latest", tmp_path / "checkpoints", tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint directory"):
        ckpt.resolve("nowhere/step-0000005", tmp_path / "checkpoints", tmp_path)
    saved = ckpt.save(tmp_path / "elsewhere", 5, {}, {})
    assert ckpt.resolve("elsewhere/step-0000005", tmp_path / "checkpoints", tmp_path) == saved


def test_state_json_is_plain_json_no_pickles(tmp_path):
    params, opt = _trained_optimizer()
    tensors, meta = ckpt.optimizer_tensors(opt, list(params))
    path = ckpt.save(tmp_path, 1, {"optimizer": tensors}, {"optimizer": meta})
    raw = json.loads((path / "state.json").read_text())
    assert raw["optimizer"]["param_groups"][0]["params"] == list(params)
    assert all(k.split("/")[1] in ("step", "exp_avg", "exp_avg_sq") for k in tensors)
