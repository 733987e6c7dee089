import pytest
import torch

from tuneline.stages.train.quantize import check_supported


def test_fp8_refused_on_cpu_naming_the_field():
    with pytest.raises(ValueError, match="model.quantize fp8"):
        check_supported("fp8", torch.device("cpu"))


def test_int8_accepted_on_cpu():
    check_supported("int8", torch.device("cpu"))


def saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves in module's forward, and the input's gradient."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    (grad,) = torch.autograd.grad(y, x, torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
    return sum(saved), grad


def test_int8_base_saves_no_dequantized_weight_and_gives_the_dequantized_gradient():
    from tuneline.stages.train.quantize import quantize_base

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 128).to(torch.bfloat16).requires_grad_(False)
    quantize_base(layer, "int8", torch.device("cpu"))
    reference = torch.nn.Linear(256, 128).to(torch.bfloat16).requires_grad_(False)
    reference.weight.copy_(layer.weight.dequantize())
    reference.bias.copy_(layer.bias)
    x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    ours, grad = saved_bytes(layer, x)
    theirs, expected = saved_bytes(reference, x)
    assert theirs >= 128 * 256 * 2  # autograd's own linear keeps the full-precision weight
    assert ours == 0
    torch.testing.assert_close(grad, expected, atol=1e-3, rtol=1.6e-2)
    torch.testing.assert_close(layer(x.detach()), reference(x.detach()), atol=2e-2, rtol=2e-2)


def test_under_autocast_a_float32_input_gets_the_gradient_autograd_gives():
    """bf16 autocast over float32 layers, as a float32 base trains under train.mixed_precision bf16: the backward's
    matmul runs in the dtype the forward's ran in, and the input's gradient comes back float32."""
    from tuneline.stages.train.quantize import FrozenQuantizedLinear, quantize_base

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 64)).requires_grad_(False)
    quantize_base(model, "int8", torch.device("cpu"))
    assert all(type(m) is FrozenQuantizedLinear for m in model)
    reference = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 64)).requires_grad_(False)
    for ours, theirs in zip(model, reference, strict=True):
        theirs.weight.copy_(ours.weight.dequantize())
        theirs.bias.copy_(ours.bias)
    x = torch.randn(4, 256, requires_grad=True)
    grads = []
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
            assert m(x.detach()).dtype == torch.bfloat16  # computed in autocast's dtype, as autocast's own linear
        assert y.dtype == torch.bfloat16
        grads.append(torch.autograd.grad(y, x, torch.ones_like(y))[0])
    assert grads[0].dtype == torch.float32
    torch.testing.assert_close(grads[0], grads[1], atol=2e-2, rtol=2e-2)


def test_the_base_reaches_the_device_one_full_precision_layer_at_a_time():
    """quantize_base takes the base from the host and moves each linear to the device as it quantizes it: the
    full-precision weights on the device never add up to more than one layer's (the meta device stands in for a
    GPU: torchao quantizes there too)."""
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

    from tuneline.stages.train.quantize import quantize_base

    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)), torch.nn.LayerNorm(64))
    model = model.to(torch.bfloat16).requires_grad_(False)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    on_device = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            plain = [m.weight for m in linears if not is_traceable_wrapper_subclass(m.weight)]
            on_device.append(sum(w.nbytes for w in plain if w.device.type == "meta"))
            return out

    with Watch():
        quantize_base(model, "int8", torch.device("meta"))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(is_traceable_wrapper_subclass(m.weight) for m in linears)
    assert max(on_device) == 64 * 64 * 2  # one bf16 layer, never two
