"""Wan 2.2 A14B as ComfyUI distributes it: one `diffusion_models/` file per timestep expert, in Wan's original layout
(each expert has Wan 2.1 14B's keys), named by the expert it holds: `wan2.2_t2v_high_noise_14B_fp16.safetensors`
and `wan2.2_t2v_low_noise_14B_fp16.safetensors` (or `..._fp8_scaled`).

The rule: model.path names either expert's file; the other expert's file is the same name with `high_noise` and
`low_noise` swapped, in the same folder. A run of both experts (model.expert both or null) needs both files. A run of
one expert (high or low) needs only its own: when the other file is absent, its base weights also fill the other
expert's place, so the stock WanPipeline, which denoises with both, can render the run's validation clips (the other
expert's steps then run on the trained expert's weights without its LoRA). The two files must be the two experts of
one model: the same tensor names and shapes, and not the same expert twice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tuneline.stages.families.fp8 import DROPPED, SCALES
from tuneline.stages.families.split_files import PREFIXES
from tuneline.stages.families.wan22.experts import HIGH, LOW

# ComfyUI's names: `high_noise` / `low_noise` (any case, `_` or `-`), once in the file name.
EXPERT_NAME = re.compile(r"(high|low)(?=[_-]noise)", re.IGNORECASE)
OTHER = {HIGH: LOW, LOW: HIGH}
WORD = {HIGH: "high", LOW: "low"}
# A weight every Wan expert has and that two different experts never share: equal bytes mean one expert twice.
TELLING = "blocks.0.self_attn.q.weight"
EXAMPLE = "wan2.2_t2v_high_noise_14B_fp16.safetensors and wan2.2_t2v_low_noise_14B_fp16.safetensors"


def expert_files(file: Path, folder: Path, expert: str | None) -> dict[str, Path]:
    """Expert component -> the file its weights come from, for model.path `file` over the model.config `folder`
    and model.expert `expert`; a folder of one transformer (no experts) takes `file` as that transformer."""
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    if sum((index.get(c) or [None])[0] is not None for c in (HIGH, LOW)) < 2:
        return {HIGH: file}
    named = named_expert(file, folder)
    files = {named: file, OTHER[named]: sibling(file)}
    held = (HIGH, LOW) if expert in (None, "both") else ((HIGH,) if expert == "high" else (LOW,))
    for comp in held:
        if not files[comp].is_file():
            raise ValueError(missing_message(file, files[comp], comp, expert))
    if files[OTHER[named]].is_file():
        check_pair(files[HIGH], files[LOW])
        return {HIGH: files[HIGH], LOW: files[LOW]}
    return {HIGH: files[held[0]], LOW: files[held[0]]}


def named_expert(file: Path, folder: Path) -> str:
    """The expert component `file`'s name says it holds; ValueError naming the rule when it names neither or both."""
    found = {m.lower() for m in EXPERT_NAME.findall(file.name)}
    if len(found) != 1:
        raise ValueError(
            f"model.path: {file} is one transformer file, but the model of model.config {folder} has two timestep "
            f"experts (transformer, transformer_2), distributed as one file each and named by the expert with "
            f"high_noise or low_noise ({EXAMPLE}); its name has "
            f"{'both' if found else 'neither'}. Give either expert's file under its ComfyUI name (the other is found "
            f"beside it by that name), or set model.path to a local diffusers folder holding both experts"
        )
    return HIGH if found == {"high"} else LOW


def sibling(file: Path) -> Path:
    """`file`'s name with high and low swapped, keeping their case (`HIGH_NOISE` -> `LOW_NOISE`)."""

    def swap(m: re.Match) -> str:
        word = "low" if m[1].lower() == "high" else "high"
        return word.upper() if m[1].isupper() else word.capitalize() if m[1][0].isupper() else word

    return file.with_name(EXPERT_NAME.sub(swap, file.name))


def missing_message(given: Path, wanted: Path, comp: str, expert: str | None) -> str:
    which = "model.expert null (both experts)" if expert is None else f"model.expert {expert}"
    alone = WORD[OTHER[comp]]
    return (
        f"model.path: {which} trains the {WORD[comp]}-noise expert, whose file is looked for beside {given} as "
        f"{wanted.name} (ComfyUI's name: {given.name} with high_noise and low_noise swapped), and {wanted} does not "
        f"exist; put the {WORD[comp]}-noise expert's file there under that name, or set model.expert {alone} to train "
        f"the {alone}-noise expert alone (a one-expert run needs only its own expert's file)"
    )


def _shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The file's weight names (prefix and fp8 scales aside) and shapes, from its header."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        out = {}
        for k in f.keys():
            if k.endswith(SCALES + DROPPED + ("scaled_fp8",)):
                continue
            name = next((k.removeprefix(p) for p in PREFIXES if k.startswith(p)), k)
            out[name] = tuple(f.get_slice(k).get_shape())
        return out


def _telling(file: Path) -> bytes | None:
    """The raw bytes of the file's TELLING weight (None: it has none)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        key = next((p + TELLING for p in ("", *PREFIXES) if p + TELLING in f.keys()), None)
        return None if key is None else f.get_tensor(key).contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def check_pair(high: Path, low: Path) -> None:
    """Refuse two files that are not the two experts of one model: one file twice, different tensor names or
    shapes (e.g. a T2V and an I2V expert, or a 14B and a 5B transformer), or the same weights under both names."""
    fix = f"give the high- and low-noise files of one Wan 2.2 A14B model, named as ComfyUI names them ({EXAMPLE})"
    if high.resolve() == low.resolve():
        raise ValueError(f"model.path: {high} and {low} are the same file, not two experts; {fix}")
    a, b = _shapes(high), _shapes(low)
    if a != b:
        key = sorted(set(a) ^ set(b)) or sorted(k for k in a if a[k] != b[k])
        k = key[0]
        raise ValueError(
            f"model.path: {high} and {low} are not the two experts of one model: {k} is "
            f"{list(a[k]) if k in a else 'missing'} in the first and {list(b[k]) if k in b else 'missing'} in the "
            f"second; {fix}"
        )
    tell = _telling(high)
    if tell is not None and tell == _telling(low):
        raise ValueError(
            f"model.path: {high} and {low} hold the same weights ({TELLING} is equal): one expert under both names, "
            f"so one expert would denoise every step; {fix}"
        )
