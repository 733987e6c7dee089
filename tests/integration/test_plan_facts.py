"""The plan's model facts kept on disk (stages/train/planfacts.py): a second plan of the same model reads them and
builds nothing, plans the same; anything they depend on is a new key; the shipped facts are those of today's code
for every shipped config's default plan and every family's tiny flavor planned on a CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.integration.test_train_support import small_config
from tuneline.schemas.model import SHIPPED_CONFIGS
from tuneline.stages.families.registry import family_names, get_family
from tuneline.stages.families.resolve import dtypes
from tuneline.stages.families.shipped import shipped_dir
from tuneline.stages.train import planfacts
from tuneline.stages.train.memplan import CUDA_RESERVE, amp_dtype, fix_edges, planned_controls, planner_for
from tuneline.stages.train.planning import model_user_config, tiny_user_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    fam = get_family("tiny")
    return fam, fam.ensure_model(None, tmp_path_factory.mktemp("models"))


def planned(cfg, model_dir, free=None):
    """The plan on a card a little too small (the fix search reads more facts), and its planner."""
    planner = planner_for(cfg, model_dir, True)
    free = free or CUDA_RESERVE + int(0.9 * (planner.total(planner.current()) - CUDA_RESERVE))
    p = planner.plan(free, "a small card")
    planner.facts.save()
    return planner, p


def test_a_second_plan_reads_the_facts_and_builds_nothing(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNELINE_CACHE_DIR", str(tmp_path / "cache"))
    fam, model_dir = tiny
    cfg = small_config(tmp_path, {"validate_every": 5, "mode": "lora"})
    first, p1 = planned(cfg, model_dir)
    assert first.facts.added and "den" in first.facts.__dict__  # built on the meta device, traced
    kept = tmp_path / "cache" / "plan-facts" / f"{first.facts.key}.json"
    assert set(json.loads(kept.read_text())) >= {"counts", "describe/None", "render", "trace/64"}
    second, p2 = planned(cfg, model_dir, p1.free)
    assert not second.facts.added and "den" not in second.facts.__dict__
    assert p2.terms == p1.terms and p2.fixes == p1.fixes and p1.fixes and p2.as_json() == p1.as_json()
    # What the facts depend on is in the key: the adapter's rank, the model's config.
    ranked = small_config(tmp_path, {"validate_every": 5, "mode": "lora", "lora_rank": 4})
    assert planner_for(ranked, model_dir, True).facts.key != first.facts.key
    monkeypatch.setenv("TUNELINE_PLAN_CACHE", "off")
    assert (
        planfacts.known(first.facts.key) == {} and planfacts.cache_file(first.facts.key) is None
    )  # afresh, kept nowhere


def test_a_changed_model_config_is_a_new_key(tiny, tmp_path):
    fam, model_dir = tiny
    t = small_config(tmp_path, {}).train
    key = planfacts.fingerprint(fam, model_dir, t, torch.float32, 0)
    copy = tmp_path / "model"
    (copy / fam.denoiser_component).mkdir(parents=True)
    config = json.loads((model_dir / fam.denoiser_component / "config.json").read_text())
    for comp in ("vae", *fam.text_components):
        (copy / comp).mkdir()
        (copy / comp / "config.json").write_bytes((model_dir / comp / "config.json").read_bytes())
    (copy / fam.denoiser_component / "config.json").write_text(json.dumps(config))
    assert planfacts.fingerprint(fam, copy, t, torch.float32, 0) != key  # same values, other text: a new key
    # The VAE's latent normalisation is no fact's input (the tiny flavors measure it, to the machine's rounding)
    renormed = copy.with_name("renormed")
    shutil.copytree(copy, renormed)
    vae = json.loads((model_dir / "vae" / "config.json").read_text())
    vae |= {"scaling_factor": vae["scaling_factor"] * 1.0000001, "latents_mean": [0.1] * vae["latent_channels"]}
    (renormed / "vae" / "config.json").write_text(json.dumps(vae))
    assert planfacts.fingerprint(fam, renormed, t, torch.float32, 0) == planfacts.fingerprint(
        fam, copy, t, torch.float32, 0
    )
    assert planfacts.fingerprint(fam, copy, t, torch.float32, 1) != planfacts.fingerprint(
        fam, copy, t, torch.float32, 0
    )
    # a step under autocast saves other tensors (memtrace casts as CUDA autocast does): another key
    assert planfacts.fingerprint(fam, copy, t, torch.float32, 0, torch.bfloat16) != planfacts.fingerprint(
        fam, copy, t, torch.float32, 0
    )


@pytest.mark.parametrize("name", sorted(SHIPPED_CONFIGS))
def test_the_shipped_facts_are_todays_for_every_default_plan(name):
    """Fails after a change to the code the facts come from: `python -m tuneline.stages.train.planfacts`
    writes them again (until then `tuneline plan --model-config` computes them, in seconds, not wrongly)."""
    cfg = model_user_config(name, None)
    fam, model_dir = get_family(SHIPPED_CONFIGS[name]), shipped_dir(name)
    dtype = dtypes()[cfg.model.dtype]
    amp = amp_dtype(cfg, cfg.train.mixed_precision != "no")  # the shipped plans are CUDA plans
    key = planfacts.fingerprint(fam, model_dir, cfg.train, dtype, planned_controls(cfg, fam), amp)
    shipped = json.loads(planfacts.SHIPPED.read_text(encoding="utf-8"))
    assert key in shipped, f"{name}: plan_facts.json is stale; run `python -m tuneline.stages.train.planfacts`"
    planner = planner_for(cfg, model_dir, True, SHIPPED_CONFIGS[name])  # reads the shipped facts: builds nothing
    edge, frames = planner.current().edge, planner.current().frames
    edges = [edge, *fix_edges(edge, planner.alignment)]
    wanted = {"counts", "render", "describe/None", "describe/fp8", *(planfacts.trace_key(e, frames) for e in edges)}
    assert wanted <= set(shipped[key]) and "den" not in planner.facts.__dict__


@pytest.fixture(scope="module")
def flavors(tmp_path_factory):
    return tmp_path_factory.mktemp("flavors")


@pytest.mark.parametrize("family", family_names())
def test_the_shipped_facts_hold_every_tiny_flavors_cpu_plan(family, flavors, tmp_path, monkeypatch):
    """The demo and a first trial run of a family (model.path null, on the CPU, LoRA or full) plan from the
    shipped facts: the `tuneline run` process imports neither diffusers nor peft to plan its training."""
    monkeypatch.setenv("TUNELINE_CACHE_DIR", str(tmp_path / "cache"))  # the shipped facts alone
    model_dir = get_family(family).ensure_model(None, flavors)
    shipped = json.loads(planfacts.SHIPPED.read_text(encoding="utf-8"))
    for mode in planfacts.TINY_MODES:
        planner = planner_for(tiny_user_config(family, mode, str(flavors)), model_dir, False)
        key = planner.facts.key
        assert key in shipped, (
            f"{family} {mode}: plan_facts.json is stale; run `python -m tuneline.stages.train.planfacts`"
        )
        planner.plan(None, "cpu")
        assert not planner.facts.added and "den" not in planner.facts.__dict__, f"{family} {mode}: built a model"
