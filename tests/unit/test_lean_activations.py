"""The lean norms and LoRA inputs (stages/train/lean.py): the same outputs and gradients as the layers they stand
for, with less kept for the backward."""

import copy
import math

import pytest
import torch
from diffusers.models.normalization import RMSNorm

from tuneline.stages.train.lean import lean_activations


def saved_storages(fn, *inputs) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """(bytes of the distinct storages autograd saves in fn's forward, the output, the inputs' gradients for one
    fixed upstream gradient, the same bf16 values at any dtype)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(*inputs)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grads = torch.autograd.grad(y, inputs, upstream.to(y.dtype))
    return sum(seen.values()), y, list(grads)


def norms() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    out = [RMSNorm(64, eps=1e-6), torch.nn.RMSNorm(64, eps=1e-6), torch.nn.LayerNorm(64, elementwise_affine=False)]
    out.append(torch.nn.LayerNorm(64))
    for m in out:
        for p in m.parameters():
            p.data = (1 + 0.1 * torch.randn_like(p)).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("index", range(4), ids=["diffusers_rms", "torch_rms", "layer_norm", "layer_norm_affine"])
def test_lean_norm_matches_the_layer_and_keeps_only_its_input(index):
    """bf16 input as a block feeds it: the output within one bf16 rounding of the original's, the input's and a
    trained weight's gradients within bf16 tolerance of the original's in float64, and only the input plus one
    float32 statistic per row kept (the original keeps a float32 copy of the input besides)."""
    original = norms()[index]
    lean = copy.deepcopy(original)
    lean_activations(lean, half_base=False)
    assert type(lean) is not type(original) and set(lean.state_dict()) == set(original.state_dict())
    for m in (original, lean):
        m.requires_grad_(True)
    x = (torch.randn(4, 32, 64) * 3).to(torch.bfloat16).requires_grad_(True)
    kept, y, (gx,) = saved_storages(lean, x)
    base, y0, _ = saved_storages(original, x)
    rows = 4 * 32
    assert kept <= x.numel() * 2 + 2 * rows * 4 + sum(p.numel() * 2 for p in lean.parameters())
    if index < 2:  # RMSNorm: diffusers' keeps a float32 copy; layer_norm on the CPU runs in bf16 (CUDA: float32)
        assert base > kept + x.numel() * 4 - 1
    assert y.dtype == x.dtype
    torch.testing.assert_close(y.float(), y0.float(), rtol=1e-2, atol=1e-2)
    reference = copy.deepcopy(original).double()
    xd = x.detach().double().requires_grad_(True)
    _, _, (gd,) = saved_storages(reference, xd)
    torch.testing.assert_close(gx.double(), gd, rtol=2e-2, atol=2e-2 * gd.abs().max().item())
    for p, q in zip(lean.parameters(), reference.parameters(), strict=True):
        (gp,) = torch.autograd.grad(lean(x).float().pow(2).sum(), p)
        (gq,) = torch.autograd.grad(reference(xd).pow(2).sum(), q)
        torch.testing.assert_close(gp.double(), gq, rtol=3e-2, atol=3e-2 * gq.abs().max().item())


def test_lean_rms_norm_without_eps_matches_torchs():
    """eps None: the lean RMSNorm adds the epsilon torch's does (float32's, for bf16 input), which matters for
    small activations: rows of mean square near bf16's epsilon."""
    original = torch.nn.RMSNorm(64)
    original.weight.data = original.weight.data.to(torch.bfloat16)
    lean = copy.deepcopy(original)
    lean_activations(lean, half_base=False)
    x = (torch.randn(4, 32, 64) * 1e-2).to(torch.bfloat16)
    torch.testing.assert_close(lean(x).float(), original(x).float(), rtol=1e-2, atol=1e-2)


def test_lean_norm_leaves_float32_exact():
    """Float32 (the CPU's training dtype) runs the layer's own forward: the same bits."""
    for original in norms():
        original.float()
        lean = copy.deepcopy(original)
        lean_activations(lean, half_base=False)
        x = torch.randn(2, 8, 64)
        assert torch.equal(lean(x), original(x))


def test_lora_over_a_half_base_reads_its_input_once_under_autocast():
    """Three LoRA projections of one input over a bf16 base, under autocast: without peft's cast to float32 the
    same outputs and gradients bit for bit, and one saved copy of the input instead of three."""
    from peft import LoraConfig, inject_adapter_in_model

    class Qkv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(64, 64, bias=False) for _ in range(3))

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    torch.manual_seed(0)
    model = Qkv().to(torch.bfloat16).requires_grad_(False)
    model = inject_adapter_in_model(LoraConfig(r=4, target_modules=["q", "k", "v"], init_lora_weights=False), model)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    lean = copy.deepcopy(model)
    lean_activations(lean, half_base=True)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, y, grads = saved_storages(lean, x)
        base, y0, grads0 = saved_storages(model, x)
    assert torch.equal(y, y0) and all(torch.equal(a, b) for a, b in zip(grads, grads0, strict=True))
    assert base - kept >= 2 * x.numel() * 2


HALVES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "none": None}


@pytest.mark.parametrize(
    "norm, x_dtype, w_dtype",
    [("rms", "bf16", "none"), ("rms", "fp16", "fp16"), ("rms", "bf16", "fp32"), ("rms", "fp16", "bf16")]
    + [("layer_norm", "bf16", "fp32")],
)
def test_lean_norm_in_each_dtype_mix_gives_the_layers_dtype_and_gradients(norm, x_dtype, w_dtype):
    """No weight or one of the input's dtype takes torch's fused RMSNorm; a float32 weight (a float32 output, so a
    float32 upstream gradient against a bf16 input) and fp16 input with a bf16 weight the elementwise maths; a
    float32 LayerNorm weight under a bf16 input the float32 call without casting it. Each: the original's output
    dtype, values within one rounding, gradients within half-precision tolerance of float64's, and only the input,
    float32 row statistics and the weight kept."""
    torch.manual_seed(0)
    x_dtype, w_dtype = HALVES[x_dtype], HALVES[w_dtype]
    if norm == "rms":
        original = RMSNorm(64, eps=1e-6, elementwise_affine=w_dtype is not None)
    else:
        original = torch.nn.LayerNorm(64)
    for p in original.parameters():
        p.data = (1 + 0.1 * torch.randn_like(p)).to(w_dtype)
    lean = copy.deepcopy(original)
    lean_activations(lean, half_base=False)
    for m in (original, lean):
        m.requires_grad_(True)
    x = (torch.randn(4, 32, 64) * 3).to(x_dtype).requires_grad_(True)
    kept, y, (gx,) = saved_storages(lean, x)
    _, y0, _ = saved_storages(original, x)
    stats = (1 if norm == "rms" else 2) * 4 * 32 * 4
    assert kept <= x.numel() * x.element_size() + stats + sum(p.numel() * p.element_size() for p in lean.parameters())
    assert y.dtype == y0.dtype
    torch.testing.assert_close(y.float(), y0.float(), rtol=1e-2, atol=1e-2)
    reference = copy.deepcopy(original).double()
    xd = x.detach().double().requires_grad_(True)
    _, _, (gd,) = saved_storages(reference, xd)
    assert gx.dtype == x.dtype
    torch.testing.assert_close(gx.double(), gd, rtol=2e-2, atol=2e-2 * gd.abs().max().item())
    for p, q in zip(lean.parameters(), reference.parameters(), strict=True):
        (gp,) = torch.autograd.grad(lean(x).float().pow(2).sum(), p)
        (gq,) = torch.autograd.grad(reference(xd).pow(2).sum(), q)
        assert gp.dtype == p.dtype
        torch.testing.assert_close(gp.double(), gq, rtol=3e-2, atol=3e-2 * gq.abs().max().item())


def test_lean_rms_norm_weight_gradient_on_the_cpu_is_the_fused_forwards():
    """A bf16 RMSNorm takes the fused forward on the CPU too (torch's composite: x/rms not rounded before the scale);
    the weight's gradient is then of those unrounded values, as CUDA's fused backward takes it: equal to float64's,
    rounded once to bf16 (all but a value or two, whose float32 sums may round the other way; rounded before the
    scale, 24 of the 64 differ)."""
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(64)).bfloat16()
    lean_activations(norm, half_base=False)
    x = (torch.randn(8, 128, 64) * 3).bfloat16().requires_grad_(True)
    upstream = torch.randn(8, 128, 64).bfloat16()
    (gw,) = torch.autograd.grad(norm(x), [norm.weight], upstream)
    xd = x.detach().double()
    xhat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert int((gw != (upstream.double() * xhat).flatten(0, -2).sum(0).bfloat16()).sum()) <= 2


def passes(norm: torch.nn.Module, x: torch.Tensor, full: bool = True) -> dict[str, list[str]]:
    """The aten ops the norm's forward and backward call themselves (not the ops inside those) that read or write a
    tensor of x's size (`full`; else every one): each a pass over the activations, a kernel of its own on CUDA."""
    from torch.profiler import profile, record_function

    with profile(record_shapes=True) as prof:
        with record_function("forward"):
            y = norm(x)
        upstream = torch.ones_like(y)
        with record_function("backward"):
            torch.autograd.grad(y, [x, *(p for p in norm.parameters() if p.requires_grad)], upstream)
    ops = {"forward": [], "backward": []}
    for e in prof.events():
        chain = [e]
        while chain[-1].cpu_parent is not None:
            chain.append(chain[-1].cpu_parent)
        inside = any(a.name.startswith(("aten::", "prims::")) for a in chain[1:])  # torch's own decomposition
        sizes = [math.prod(s) for s in e.input_shapes if s]
        if chain[-1].name in ops and e.name.startswith("aten::") and not inside and (not full or x.numel() in sizes):
            ops[chain[-1].name].append(e.name.removeprefix("aten::"))
    return ops


def test_lean_norms_on_cuda_run_one_kernel_each_way():
    """A profile of a Z-Image LoRA step had a third of its GPU time in the lean RMSNorm's 6 forward and 14 backward
    passes over each (tokens x 3840) activation (10 with a frozen weight). Over a bf16 base, torch's fused RMSNorm is
    one call each way, and a bf16 LayerNorm (host-bound on SDXL: 8 ops a backward) one call each way, nothing else
    dispatched. Traced on the meta device, which takes CUDA's path (the memory plan traces there); a float32 weight
    keeps its elementwise maths, in fewer passes than the 5 forward and 12 backward it took before."""
    torch.manual_seed(0)
    x = torch.randn(1, 64, 3840, device="meta", dtype=torch.bfloat16, requires_grad=True)
    one_each = {"forward": ["_fused_rms_norm"], "backward": ["_fused_rms_norm_backward"]}
    for original in (RMSNorm(3840, eps=1e-6), torch.nn.RMSNorm(3840, eps=1e-6), RMSNorm(3840, 1e-6, False)):
        lean = original.to("meta", torch.bfloat16).requires_grad_(True)
        lean_activations(lean, half_base=True)
        assert passes(lean, x) == one_each
    lean = RMSNorm(3840, eps=1e-6).to("meta")  # float32 weight: a float32 output, diffusers' dtype
    lean_activations(lean, half_base=True)
    found = passes(lean, x)
    assert found["forward"][0] == "_fused_rms_norm" and len(found["forward"]) <= 3
    assert len([op for op in found["backward"] if op not in ("flatten", "empty_like")]) <= 9
    lean = torch.nn.LayerNorm(3840).to("meta", torch.bfloat16).requires_grad_(True)
    lean_activations(lean, half_base=True)
    everything = passes(lean, x, full=False)
    assert everything == {"forward": ["native_layer_norm"], "backward": ["native_layer_norm_backward"]}


def gates() -> list[tuple[torch.nn.Module, int, int]]:
    """(module, input width, gate width): Z-Image's feed-forward and FLUX.2's SwiGLU, bf16."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU
    from diffusers.models.transformers.transformer_z_image import FeedForward

    torch.manual_seed(0)
    return [(FeedForward(32, 96).to(torch.bfloat16), 32, 96), (Flux2SwiGLU(), 192, 96)]


@pytest.mark.parametrize("index", range(2), ids=["z_image_feed_forward", "flux2_swiglu"])
def test_lean_swiglu_gate_gives_autograds_values_and_keeps_no_silu(index):
    """The lean gate's output and every gradient equal autograd's bit for bit; it keeps its two inputs, not
    silu(gate) beside them (one tensor of the inner width less per block)."""
    original, width, inner = gates()[index]
    lean = copy.deepcopy(original)
    lean_activations(lean, half_base=True)
    assert type(lean) is not type(original) and set(lean.state_dict()) == set(original.state_dict())
    x = torch.randn(2, 64, width, dtype=torch.bfloat16, requires_grad=True)
    ours, y, grads = saved_storages(lean, x)
    theirs, expected, expected_grads = saved_storages(original, x)
    assert torch.equal(y, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        assert torch.equal(g, e)
    for p, q in zip(lean.parameters(), original.parameters(), strict=True):
        assert torch.equal(
            *(torch.autograd.grad(m(x).float().pow(2).sum(), w)[0] for m, w in ((lean, p), (original, q)))
        )
    assert theirs - ours == 2 * 64 * inner * 2  # silu(gate), bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grads", [(True, False), (False, True)], ids=["gate_only", "up_only"])
def test_lean_swiglu_gate_gives_only_the_gradients_asked_for(dtype, grads):
    """One input without a gradient (a frozen path): the other's gradient is autograd's, bit for bit, under
    autocast too."""
    from tuneline.stages.train.lean import _SiluGate

    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(4, 32, generator=gen, dtype=dtype).requires_grad_(g) for g in grads)
    wanted = [t for t in (gate, up) if t.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = torch.autograd.grad(_SiluGate.apply(gate, up).float().pow(2).sum(), wanted)
        theirs = torch.autograd.grad((torch.nn.functional.silu(gate) * up).float().pow(2).sum(), wanted)
    assert len(ours) == 1 and torch.equal(ours[0], theirs[0])
