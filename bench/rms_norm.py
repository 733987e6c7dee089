"""Benchmark: the lean RMSNorm's forward and backward against diffusers' own RMSNorm's, on one block's activation.

What a LoRA step over a bf16 base runs per norm: a bf16 (1, 1024, 3840) input (Z-Image's width, 1024 tokens) that
needs its gradient, the norm's bf16 weight frozen. The lean side is the norm as training uses it
(`tuneline.stages.train.lean`: torch's fused RMSNorm kernels where the device has them, on CUDA; on the CPU the
forward is torch's composite and the backward elementwise), the reference diffusers' `RMSNorm.forward` and its
autograd backward, the same input, weight and upstream gradient. Each round times `--steps` forward+backward
passes of each side back to back (alternating which goes first); the RESULT is the median of the per-round ratios,
diffusers' seconds over the lean norm's (goal >= 1: no slower than what it replaces).

`python bench/rms_norm.py` (CPU); `--device cuda` runs the same on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusers.models.normalization import RMSNorm  # noqa: E402

from tuneline.stages.train.lean import lean_activations  # noqa: E402

GOAL = 1.0


def seconds(norm, x, upstream, steps: int, device: torch.device) -> float:
    """Wall seconds of `steps` forward+backward passes (the gradient of the input only, as LoRA trains)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        torch.autograd.grad(norm(x), x, upstream)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def agree(lean, reference, x, upstream) -> None:
    """Before timing: the lean norm's output within four bf16 roundings of diffusers' at the largest value (it
    rounds once where diffusers rounds twice) and its input gradient within 2 % of the largest; a device whose
    kernels disagree stops here."""
    (y, ref) = (lean(x), reference(x))
    (g,), (g_ref,) = (torch.autograd.grad(y, x, upstream), torch.autograd.grad(ref, x, upstream))
    out = (y.float() - ref.float()).abs().max().item()
    grad = ((g.float() - g_ref.float()).abs().max() / g_ref.float().abs().max()).item()
    print(f"agreement with diffusers: output max |diff| {out:.4f}, input gradient max |diff| {grad:.2e} of its largest")
    if out > y.float().abs().max().item() / 64 or grad > 2e-2:  # bf16 rounds a value v by up to v / 256
        raise SystemExit("the lean RMSNorm disagrees with diffusers' on this device: see stages/train/lean.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="1,1024,3840", help="batch,tokens,width")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device, shape = torch.device(args.device), tuple(int(n) for n in args.shape.split(","))
    torch.manual_seed(0)
    reference = RMSNorm(shape[-1], eps=1e-6).to(device, torch.bfloat16).requires_grad_(False)
    reference.weight.data = 1 + 0.1 * torch.randn_like(reference.weight)
    lean = copy.deepcopy(reference)
    lean_activations(lean, half_base=True)
    x = (torch.randn(shape, device=device) * 3).to(torch.bfloat16).requires_grad_(True)
    upstream = torch.randn(shape, device=device).to(torch.bfloat16)
    agree(lean, reference, x, upstream)
    for norm in (reference, lean):  # warm-up: allocator, kernels
        seconds(norm, x, upstream, 2, device)
    ratios, times = [], {"lean": [], "diffusers": []}
    for r in range(args.rounds):
        order = [("lean", lean), ("diffusers", reference)][:: 1 if r % 2 else -1]
        took = {name: seconds(norm, x, upstream, args.steps, device) for name, norm in order}
        for name in took:
            times[name].append(took[name] / args.steps)
        ratios.append(took["diffusers"] / took["lean"])
    print(f"device {device}, input {list(shape)} bf16, torch {torch.__version__}, {args.rounds} rounds of {args.steps}")
    for name, ts in times.items():
        print(f"{name}: forward+backward median {statistics.median(ts) * 1e3:.2f} ms (best {min(ts) * 1e3:.2f} ms)")
    ratio = statistics.median(ratios)
    print(f"RESULT rms_norm_vs_diffusers {ratio:.3f} goal >= {GOAL} {'PASS' if ratio >= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
