"""The training matrix: every registered family's tiny flavor, the base LoRA cell and one factor at a time around
it (tests/integration/matrix_cells.py derives them from the registry and the config schema), each trained in 2
DDP processes (gloo, torchrun) through the train stage's worker, 2 optimizer steps of 2 accumulated micro-batches.
Per cell:

(a) on every rank every trainable parameter has a gradient at step 1 (DDP's reducer saw it) and a finite,
    non-zero one at step 2 (adapters start with one factor at zero, so step 1 may be zero); of a family with
    timestep experts each step trains one expert, the same on every rank, each in one of the steps;
(b) the 2-process weights after step 2 equal a 1-process replay of the same global batch within REPLAY_TOLERANCE;
(c) resuming from the step-1 checkpoint gives bit-identical step-2 weights;
(d) the exports load: the diffusers file (or a full fine-tune's pipeline folder) in the stock diffusers pipeline,
    holding exactly the trained weights (each expert's file in its component); the kohya/LyCORIS file(s) with only
    stems ComfyUI maps for the family.

The FSDP column (cells `<family>-<factor>-fsdp`) asserts the same with train.parallelism fsdp: gradients judged
whole (gathered from the shards), weights gathered whole (tuneline.stages.train.fsdp.full) equal the 1-process
DDP replay, resume from the sharded checkpoint exact, exports gathered. The edit families (and FLUX.2's
references) train with their control images, every micro-batch carrying control latents.

A cell the config refuses asserts the refusal names the changed field (and train.parallelism, for what FSDP
refuses) and a fix. One torchrun launch per part of the matrix (matrix_cells.PARTS, disjoint families) trains its
cells (the first training cell of the part to run starts it); each cell is its own test item.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import diffusers
import pytest
import torch
from safetensors.torch import load_file

from tests.integration import comfy_lora_keys
from tests.integration.matrix_cells import Cell, cells, dataset, launch, refusal
from tests.matrix_worker import TRAINED
from tuneline.stages.families.registry import get_family
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE, lora_parts, named

# fp32 weights after 2 AdamW steps at the default learning rate: DDP sums the ranks' gradients in another order
# than one process accumulating all 4 micro-batches, which moves the weights by float rounding only (seen: <3e-6).
REPLAY_TOLERANCE = 2e-5
# FSDP reduce-scatters: each shard's gradient sums the ranks' in yet another order. Where the ranks' gradients
# nearly cancel, that rounding is a large part of the gradient, and AdamW's normalised step carries it into the
# weight (seen: 1.8e-5 on flux's full fine-tune; below 5e-6 elsewhere).
FSDP_REPLAY_TOLERANCE = 5e-5
CPU = torch.device("cpu")
ADAPTER_NAME = re.compile(r"\.default(_\d+)?(?=\.|$)")


# A part's first training cell includes its launch: minutes of training on a machine the other workers share.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def launches(request, upstream_store, tmp_path_factory):
    """Part -> its one launch, training the part's cells this session selected (`-k sdxl` trains sdxl's only)."""
    wanted = [i.callspec.params["cell"] for i in request.session.items if i.function is test_cell]
    done: dict[int, tuple[Path, dict[str, Path]]] = {}

    def launched(part: int) -> tuple[Path, dict[str, Path]]:
        if part not in done:
            root = tmp_path_factory.mktemp(f"matrix{part}")
            done[part] = root, launch(upstream_store, root, [c for c in wanted if c.part == part])
        return done[part]

    return launched


@pytest.fixture(scope="module")
def stock():
    """Each family's stock diffusers pipeline, loaded once (a cell's LoRA is unloaded after its checks)."""
    loaded: dict[Path, object] = {}

    def get(fam, model_dir: Path):
        if model_dir not in loaded:
            loaded[model_dir] = fam.load_pipeline(model_dir, torch.float32, CPU)
        return loaded[model_dir]

    return get


@pytest.mark.parametrize(
    "cell", [pytest.param(c, id=c.id, marks=pytest.mark.group(f"matrix-{c.part}")) for c in cells()]
)
def test_cell(cell: Cell, request, stock, upstream_store, tmp_path):
    data = upstream_store.dataset("matrix", dataset)
    refused = refusal(cell, data, tmp_path)
    if refused is not None:
        # FSDP's own refusals name train.parallelism too; a twin DDP refuses is refused for its own reason; a family
        # FSDP cannot shard at all (its base FSDP cell is refused) is refused naming train.parallelism alone
        twin_trains = cell.fsdp and refusal(cell.ddp_twin, data, tmp_path) is None
        base = dataclasses.replace(cell, name="lora", section="", change={})
        whole_family = twin_trains and refusal(base, data, tmp_path) is not None
        fields = ["train.parallelism"] if whole_family else [cell.field] + ["train.parallelism"] * twin_trains
        assert all(f in refused for f in fields) and re.search(r"\b(set|use)\b", refused), refused
        return
    root, outs = request.getfixturevalue("launches")(cell.part)  # not for a refusal: it trains nothing
    out = outs[cell.id]
    ranks = [_result(root, out, r) for r in range(2)]
    _assert_gradients(ranks, tuple(f"experts.{c}." for c, _ in get_family(cell.family).facts.experts))
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(ranks) if "error" in res]
    assert not errors, "the cell stopped:\n" + "\n".join(errors) + "\n" + ranks[0].get("traceback", "")
    tolerance = FSDP_REPLAY_TOLERANCE if cell.fsdp else REPLAY_TOLERANCE
    assert ranks[0]["replay"] <= tolerance, f"2 processes vs 1-process replay: {ranks[0]['replay']}"
    assert [res["resume"] for res in ranks] == [0.0, 0.0], "resumed from step 1, step 2's weights must be identical"
    assert [res["sharded"] for res in ranks] == [cell.fsdp] * 2, "FSDP cells train DTensor shards, DDP ones not"
    with_control = {c for res in ranks for c in res["controls"]}
    assert with_control == {get_family(cell.family).takes_control}, "edit families train with their controls only"
    _assert_exports(cell, out, stock)


def _result(root: Path, out: Path, rank: int) -> dict:
    path = out / f"rank-{rank}.json"
    if not path.is_file():
        launch = root / "launch-error.txt"
        pytest.fail(f"rank {rank} wrote no result: {launch.read_text() if launch.is_file() else 'no launch error'}")
    return json.loads(path.read_text(encoding="utf-8"))


def _assert_gradients(ranks: list[dict], experts: tuple[str, ...] = ()) -> None:
    """A parameter's first step gives it a gradient (maybe zero: adapters start with one factor at zero), every
    later one a finite, non-zero one. `experts`: the parameter-name prefixes of timestep experts; each step
    trains one, the same on every rank (SigmaSampler.step_share), the others get no gradient in it; every expert
    must learn in some step (the matrix's seed makes them: matrix_cells.every_expert_seed), and whole."""
    bad, active, routes = [], set(), []
    for r, res in enumerate(ranks):
        seen: set[str] = set()
        route = []
        for i, states in enumerate(res["grads"][:2]):
            idle = [p for p in experts if all(s == "none" for n, s in states.items() if n.startswith(p))]
            route.append(sorted(set(experts) - set(idle)))
            active |= set(experts) - set(idle)
            states = {n: s for n, s in states.items() if not n.startswith(tuple(idle))}
            none = sorted(n for n, s in states.items() if s == "none" and n not in seen)
            wrong = sorted(f"{n} ({s})" for n, s in states.items() if s != "ok" and n in seen)
            bad += [f"rank {r} step {i + 1}: no gradient for {len(none)} parameters: {none}"] if none else []
            bad += [f"rank {r} step {i + 1}: {len(wrong)} parameters zero or non-finite: {wrong}"] if wrong else []
            seen |= set(states)
        routes.append(route)
    bad += [f"expert {p} learned in no step" for p in experts if p not in active and ranks[0]["grads"]]
    if experts:
        bad += [
            f"rank {r} trained {route}, not one expert a step as rank 0 ({routes[0]})"
            for r, route in enumerate(routes)
            if route != routes[0] or any(len(x) != 1 for x in route)
        ]
    assert not bad, "\n".join(bad)


def _assert_exports(cell: Cell, out: Path, stock) -> None:
    result = json.loads((out / "train" / "result.json").read_text(encoding="utf-8"))
    files = {e["format"]: out / "train" / e["file"] for e in result["exports"]}
    fam = get_family(cell.family)
    trained = load_file(out / TRAINED)
    model_dir = Path(json.loads((out / "cell.json").read_text(encoding="utf-8"))["model_dir"])
    if result["mode"] == "full":
        pipe = getattr(diffusers, fam.facts.pipeline).from_pretrained(files["diffusers"])
        _assert_holds(pipe, fam, trained)
        return
    assert "kohya" in files, f"no kohya/LyCORIS file among the exports: {result['exports']}"
    pipe = stock(fam, model_dir)
    final = files["kohya"].parent
    # One file per trained timestep expert (each loaded into its component), else the denoiser's
    parts = lora_parts(cell.family, final)
    if "diffusers" in files:
        for comp, suffix in parts:
            kwargs = fam.lora_load_kwargs(comp) if comp else {}
            pipe.load_lora_weights(final, weight_name=named(DIFFUSERS_FILE, suffix), **kwargs)
        try:
            _assert_holds(pipe, fam, trained)
        finally:
            pipe.unload_lora_weights()
    den = getattr(pipe, fam.denoiser_component)
    mapped = comfy_lora_keys.unet_stems(den)
    encoders = [getattr(pipe, c) for c in fam.facts.text_encoders]
    if result["text_encoder_lora"]:
        mapped |= comfy_lora_keys.clip_stems([e.config.num_hidden_layers for e in encoders])
    for _, suffix in parts:
        got = comfy_lora_keys.stems(load_file(final / named(KOHYA_FILE, suffix)))
        assert got and got <= mapped, f"stems ComfyUI maps no weight for: {sorted(got - mapped)[:10]}"


def _assert_holds(pipe, fam, trained: dict[str, torch.Tensor]) -> None:
    """Every trained tensor is in the loaded pipeline under its name (a text encoder's with its component's
    prefix, a timestep expert's with the training denoiser's `experts.<component>.`, the adapter's name aside), with
    the trained value."""
    held = {}
    experts = [comp for comp, _ in fam.facts.experts]
    for comp in (*(experts or [fam.denoiser_component]), *fam.facts.text_encoders):
        prefix = f"experts.{comp}." if experts and comp in experts else ""
        prefix = f"{comp}." if comp in fam.facts.text_encoders else prefix
        held |= {prefix + ADAPTER_NAME.sub("", n): p for n, p in getattr(pipe, comp).named_parameters()}
    missing = [n for n in trained if ADAPTER_NAME.sub("", n) not in held]
    assert not missing, f"the loaded pipeline lacks {len(missing)} trained tensors: {missing[:8]}"
    wrong = [n for n, v in trained.items() if not torch.equal(held[ADAPTER_NAME.sub("", n)].detach().float(), v)]
    assert not wrong, f"loaded values differ from the trained ones: {wrong[:8]}"
