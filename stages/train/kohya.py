"""The kohya (sd-scripts) LoRA layout that ComfyUI, A1111 and Forge load, from our diffusers/peft adapter weights.

Each kohya module is `lora_unet_<module path with '_' for '.'>` with `.lora_down.weight`, `.lora_up.weight` and
`.alpha` (the effective scale is alpha / rank, rank = lora_down's rows). The module path is the one kohya's own
trainers write for each family: its `stages/families/<family>/lora.py` maps a diffusers module path to it (e.g.
the original checkpoint's names). ComfyUI maps `lora_unet_` + any original checkpoint module name to that module.

Some original checkpoints hold q, k and v (and single blocks' MLP input) as ONE fused linear layer where
diffusers has separate ones. A fused module's LoRA is stacked: lora_down = the parts' downs one above the other,
lora_up = block-diagonal (each part's up in its rows and its own columns, zeros elsewhere), so up @ down is exactly
each part's update in its own rows; the rank grows to k * r, so alpha grows by k to keep alpha / rank.
"""

from __future__ import annotations

import torch

from tuneline.stages.families.kohya_layout import Target, lora_pairs  # noqa: F401 (callers and tests name it from here)


def kohya_name(module: str) -> str:
    """The kohya key stem for an original-layout module path."""
    return "lora_unet_" + module.replace(".", "_")


def _lora_part(family: str):
    """The family's lora.py (its kohya layout), or None when it has none."""
    from tuneline.stages.families.registry import family_part

    return family_part(family, "lora")


def layout(family: str) -> str:
    part = _lora_part(family)
    if part is None:
        from tuneline.stages.families.registry import family_names

        known = [n for n in family_names() if _lora_part(n) is not None]
        raise ValueError(
            f"train.lora_format kohya: no kohya layout is known for model.family {family!r} "
            f"(known: {', '.join(sorted(known))}); set train.lora_format diffusers"
        )
    return part.KOHYA_LAYOUT


def target(family: str, path: str, den: torch.nn.Module) -> Target | None:
    """Where the diffusers module `path` of denoiser `den` lands in the kohya layout, or None if nowhere (also for a
    family without one: ComfyUI addresses Z-Image and FLUX.2 by their diffusers names, so their LyCORIS files
    keep the `lycoris_<path>` names, stages/train/adapters.py)."""
    part = _lora_part(family)
    return part.kohya_target(path, den) if part is not None else None


def to_kohya(
    family: str, den: torch.nn.Module, peft_state: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """The kohya state dict for these adapter weights (scale alpha / rank, as peft applies it). Raises naming every
    trained module that has no place in the layout, so a file never silently drops part of the training."""
    layout(family)
    mods = lora_pairs(peft_state)
    modules = dict(den.named_modules())
    targets = {p: target(family, p, den) for p in mods}
    missing = sorted(p for p, tg in targets.items() if tg is None)
    if missing:
        raise ValueError(
            f"train.lora_format kohya: no kohya name for trained module(s) {missing} of model.family "
            f"{family}; set train.lora_format diffusers"
        )
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, Target] = {}
    for path, tg in targets.items():
        down, up = mods[path]
        if not tg.parts:
            stem = kohya_name(tg.name)
            out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down, up
            out[f"{stem}.alpha"] = torch.tensor(float(alpha))
        else:
            fused[tg.name] = tg
    for name, tg in fused.items():
        rows = [modules[p].out_features if p in modules else 0 for p in tg.parts]
        trained = [(s, p) for s, p in enumerate(tg.parts) if p in mods]
        down = torch.cat([mods[p][0] for _, p in trained], dim=0)
        rank = mods[trained[0][1]][0].shape[0]
        up = torch.zeros(sum(rows), rank * len(trained), dtype=down.dtype)
        for col, (slot, p) in enumerate(trained):
            top = sum(rows[:slot])
            up[top : top + rows[slot], col * rank : (col + 1) * rank] = mods[p][1]
        stem = kohya_name(name)
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down.contiguous(), up
        out[f"{stem}.alpha"] = torch.tensor(float(alpha) * len(trained))
    return out
