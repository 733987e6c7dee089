"""The adapter a LoRA-mode run trains (train.adapter) and its file in the LyCORIS key layout ComfyUI reads.

- lora: peft's LoRA (the kohya file comes from stages/train/kohya.py).
- dora: peft's LoRA with weight decomposition (LoraConfig(use_dora=True)).
- lokr: peft's LoKr, W += kron(w1, w2) * alpha / r (train.lokr_factor: peft's decompose_factor).
- loha: peft's LoHa, W += (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r.

Why peft rather than lycoris-lora: it is already what trains the LoRA, injected through diffusers' own adapter API
(add_adapter) into every family, UNet and transformer alike, so resume (named parameters), EMA, DDP, block swap and
the diffusers file work unchanged; the LyCORIS layout is a renaming of its tensors, checked by a test that
recomputes each module's update from the file with ComfyUI's formulas and compares it with peft's merged weights.

The file (final/lora_kohya.safetensors, for ComfyUI models/loras) names each module as the LoRA file does
(`lora_unet_<original module>`). Modules that the original checkpoint fuses (q, k and v in some transformers) cannot stack a
Kronecker or Hadamard product the way a LoRA stacks, so they keep the diffusers path as `lycoris_<path>`, the
SimpleTuner LyCORIS names ComfyUI maps onto the fused weight's rows.

Suffixes (comfy/weight_adapter/): lokr_w1, lokr_w2 (or lokr_w1_a/_b, lokr_w2_a/_b when peft factors them) and
alpha; hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b and alpha; DoRA: lora_down/lora_up/alpha plus dora_scale.
ComfyUI reads an output-axis dora_scale as m / ||W0|| (the base's row norms), where peft's magnitude m divides
the merged weight's norms ||W0 + dW||, so the file holds m * ||W0|| / ||W0 + dW||: ComfyUI then applies exactly
the trained weights (at strength 1).
"""

from __future__ import annotations

import re

import torch

from tuneline.stages.train import kohya

# diffusers' load_lora_weights reads peft LoRA and DoRA weights; it has no loader for LoKr or LoHa.
DIFFUSERS_LOADS = ("lora", "dora")
# kohya's ss_network_module / LyCORIS's algo name per adapter (the metadata A1111 and Forge show).
NETWORK = {
    "lora": ("networks.lora", None),
    "dora": ("networks.lora", "dora"),
    "lokr": ("lycoris.kohya", "lokr"),
    "loha": ("lycoris.kohya", "loha"),
}
SUFFIXES = {
    "lokr": ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
    "dora": ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector"),
}


def adapter_of(t) -> str:
    return getattr(t, "adapter", "lora")


def alpha_of(t) -> float:
    return float(t.lora_alpha or t.lora_rank)


def exclude_pattern(unused: tuple[str, ...], containers: tuple[str, ...] = ()) -> str | None:
    """peft's exclude_modules (a regex it full-matches against module paths): the `unused` modules and every module
    inside them, and the `containers` alone (None for neither). A pattern rather than a list: peft matches list
    entries by suffix only, so a listed feed-forward would leave its inner layers targeted."""
    alternatives = [f"({'|'.join(re.escape(m) for m in unused)})(\\..*)?"] if unused else []
    alternatives += [re.escape(c) for c in containers]
    return "|".join(alternatives) or None


def containers(model: torch.nn.Module, target_modules: tuple[str, ...]) -> tuple[str, ...]:
    """Module lists a target suffix also names, which peft refuses to wrap: FLUX.2's `attn.to_out` is its single
    blocks' output layer and its double blocks' list around `to_out.0`. Excluded, the suffix targets the layers."""
    return tuple(
        n
        for n, m in model.named_modules()
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
        and any(n == t or n.endswith("." + t) for t in target_modules)
    )


def peft_config(t, target_modules: tuple[str, ...], unused: tuple[str, ...] = (), lists: tuple[str, ...] = ()):
    """The peft config train.adapter names (rank train.lora_rank, alpha train.lora_alpha or the rank), on the
    modules `target_modules` names except the `unused` ones (Family.unused_modules) and the module `lists`
    (containers)."""
    adapter, targets = adapter_of(t), list(target_modules)
    common = dict(r=t.lora_rank, target_modules=targets, exclude_modules=exclude_pattern(unused, lists))
    if adapter == "lokr":
        from peft import LoKrConfig

        return LoKrConfig(**common, alpha=alpha_of(t), init_weights=True, decompose_factor=t.lokr_factor)
    if adapter == "loha":
        from peft import LoHaConfig

        return LoHaConfig(**common, alpha=alpha_of(t), init_weights=True)
    from peft import LoraConfig

    return LoraConfig(**common, lora_alpha=alpha_of(t), init_lora_weights=True, use_dora=adapter == "dora")


def not_exported(t) -> list[dict]:
    """The manifest's record of a requested file this adapter cannot have (never a refusal)."""
    adapter = adapter_of(t)
    if t.mode == "lora" and adapter not in DIFFUSERS_LOADS and t.lora_format in ("diffusers", "both"):
        return [
            {
                "format": "diffusers",
                "reason": f"train.adapter {adapter}: diffusers' load_lora_weights reads "
                f"no {adapter} weights; the LyCORIS-layout file lora_kohya.safetensors (ComfyUI, A1111, Forge) is "
                f"written instead",
            }
        ]
    return []


def _modules(state: dict[str, torch.Tensor], suffixes: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """diffusers module path -> {suffix: tensor} from a peft state dict (`<path>.<suffix>`)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        suffix = next((s for s in suffixes if key.endswith("." + s)), None)
        if suffix is None:
            raise ValueError(f"adapter weight {key} is not one this exporter knows ({', '.join(suffixes)})")
        out.setdefault(key[: -len(suffix) - 1], {})[suffix] = value
    return out


def stem(family: str, path: str, den: torch.nn.Module) -> str:
    """The file's key stem for diffusers module `path`: the LoRA file's name, or `lycoris_<path>` for a part of
    a fused original module (see the module docstring)."""
    target = kohya.target(family, path, den)
    if target is not None and not target.parts:
        return kohya.kohya_name(target.name)
    return "lycoris_" + path.replace(".", "_")


def _lokr(f: dict[str, torch.Tensor], scale: float, alpha: float) -> dict[str, torch.Tensor]:
    out = dict(f)
    if any(k.endswith(("_a", "_b")) for k in f):  # ComfyUI scales a factored product by alpha / its rank
        out["alpha"] = torch.tensor(alpha)
    else:  # two full matrices: ComfyUI (and LyCORIS) apply them at scale 1, so the file carries peft's scale
        out["lokr_w2"] = f["lokr_w2"] * scale
    return out


def _dora(f: dict[str, torch.Tensor], base: torch.Tensor, scale: float, alpha: float) -> dict[str, torch.Tensor]:
    down, up, m = f["lora_A.weight"], f["lora_B.weight"], f["lora_magnitude_vector"]
    rows = base.shape[0]
    delta = (up.reshape(rows, -1) @ down.reshape(down.shape[0], -1)).reshape(base.shape) * scale
    merged_norm = (base.float() + delta).reshape(rows, -1).norm(dim=1)
    base_norm = base.float().reshape(rows, -1).norm(dim=1) + torch.finfo(base.dtype).eps
    dora_scale = m.reshape(rows) * base_norm / merged_norm
    return {
        "lora_down.weight": down,
        "lora_up.weight": up,
        "alpha": torch.tensor(alpha),
        "dora_scale": dora_scale.reshape(rows, *[1] * (base.dim() - 1)),
    }


def to_lycoris(family: str, den: torch.nn.Module, state: dict[str, torch.Tensor], t) -> dict[str, torch.Tensor]:
    """The LyCORIS-layout state dict of a lokr/loha/dora adapter's peft weights `state`."""
    adapter, alpha = adapter_of(t), alpha_of(t)
    scale = alpha / t.lora_rank
    modules = dict(den.named_modules())
    out: dict[str, torch.Tensor] = {}
    for path, f in _modules(state, SUFFIXES[adapter]).items():
        if adapter == "lokr":
            keys = _lokr(f, scale, alpha)
        elif adapter == "loha":
            keys = {**f, "alpha": torch.tensor(alpha)}
        else:
            layer = modules[path]
            base = getattr(layer, "base_layer", layer).weight.detach().to("cpu", torch.float32)
            keys = _dora(f, base, scale, alpha)
        name = stem(family, path, den)
        out.update({f"{name}.{k}": v.detach().to("cpu", torch.float32).contiguous() for k, v in keys.items()})
    return out


def delta(f: dict[str, torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    """The weight change one module's LyCORIS keys make at strength 1, as ComfyUI computes it
    (comfy/weight_adapter/lokr.py, loha.py, lora.py and base.weight_decompose)."""
    alpha = float(f["alpha"]) if "alpha" in f else None
    if "hada_w1_a" in f:
        m1, m2 = f["hada_w1_a"] @ f["hada_w1_b"], f["hada_w2_a"] @ f["hada_w2_b"]
        return (m1 * m2).reshape(base.shape) * (alpha / f["hada_w1_b"].shape[0])
    if "lokr_w1" in f or "lokr_w1_a" in f:
        dim, w1, w2 = None, f.get("lokr_w1"), f.get("lokr_w2")
        if w1 is None:
            dim, w1 = f["lokr_w1_b"].shape[0], f["lokr_w1_a"] @ f["lokr_w1_b"]
        if w2 is None:
            dim, w2 = f["lokr_w2_b"].shape[0], f["lokr_w2_a"] @ f["lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        return torch.kron(w1, w2).reshape(base.shape) * (alpha / dim if alpha is not None and dim else 1.0)
    down, up = f["lora_down.weight"], f["lora_up.weight"]
    diff = (up.flatten(1) @ down.flatten(1)).reshape(base.shape) * ((alpha or down.shape[0]) / down.shape[0])
    if "dora_scale" not in f:
        return diff
    rows = base.shape[0]
    norm = base.reshape(rows, -1).norm(dim=1).reshape(rows, *[1] * (base.dim() - 1)) + torch.finfo(base.dtype).eps
    return (base + diff) * (f["dora_scale"] / norm) - base


def apply_file(family: str, den: torch.nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Merge a LyCORIS-layout file's updates into `den`'s weights (how validation renders a lokr/loha run, which
    diffusers cannot load). Returns the modules changed; raises naming keys that match no module."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        name, suffix = key.split(".", 1)
        groups.setdefault(name, {})[suffix] = value.float()
    layers = {
        stem(family, p, den): m for p, m in den.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
    }
    unknown = sorted(set(groups) - set(layers))
    if unknown:
        raise ValueError(f"adapter file keys match no module of {type(den).__name__}: {unknown[:5]}")
    with torch.no_grad():
        for name, f in groups.items():
            w = layers[name].weight
            w.add_(delta(f, w.detach().float()).to(w.device, w.dtype))
    return len(groups)
