"""bench/gpu.py: `--tiny` runs the GPU figures' code on the tiny flavors on the CPU, one RESULT line per CPU-able
figure and a `skipped:` line for each other; without CUDA and without --tiny it skips with exit 0."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_train_support import ROOT

# The contract's form: a second value and the anchor's may follow the PASS|FAIL word, as name-value pairs.
RESULT = re.compile(r"^RESULT (\S+) (\S+) goal (<=|>=) (\S+) (PASS|FAIL)((?: \S+ \S+)*)$")


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )


@pytest.mark.ddp(reason="the ddp_two_process_cuda figure runs two gloo ranks")
def test_tiny_runs_every_cpu_figure_and_names_the_skipped_ones(tmp_path):
    proc = _bench("--tiny", "--work", str(tmp_path), "--trace", str(tmp_path / "traces"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    results = {m.group(1): m for m in map(RESULT.match, lines) if m}
    assert list(results) == ["ddp_two_process_cuda", "sdxl_lora_step_vs_pure", "cache_vs_encoder"], proc.stdout
    assert all(float(m.group(2)) >= 0 for m in results.values())
    # Two gloo processes reach the weights of one process replaying both ranks' micro-batches.
    assert results["ddp_two_process_cuda"].group(5) == "PASS", proc.stdout
    # Beside it, what the replay differs from itself by: nothing on the CPU, whose kernels sum in a fixed order.
    assert "ddp_two_process_cuda: the one-process replay against itself 0 (" in proc.stdout, proc.stdout
    skipped = [ln for ln in lines if ln.startswith("skipped: ")]
    needs_cuda = (
        "sdxl_lora flux2_klein_lora flux2_klein_lora_int8 z_image_lora z_image_lora_ckpt flux_lora flux_lora_peak_gib "
        "cache_images_per_s sdxl_lora_step_vs_diffusers qwen_image_lora"
    )
    assert [ln.split()[1] for ln in skipped] == needs_cuda.split()
    assert all(re.fullmatch(r"skipped: \S+ \(.+\)", ln) for ln in skipped)
    # --trace: each timed loop's profiled steps and the bare step's beside them, a trace Perfetto opens and the
    # ops that took the time, printed.
    for name in (f"sdxl_lora_step-checkpointing-{s}{side}" for s in ("off", "on") for side in ("", "-bare")):
        trace = json.loads(gzip.decompress((tmp_path / "traces" / f"{name}.json.gz").read_bytes()))
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"]), name
        assert f"{name}: trace of 3 steps in " in proc.stdout and "Self CPU time total" in proc.stdout
    # It names the CUDA branches the CPU run cannot take.
    branches = next(ln for ln in lines if ln.startswith("CUDA branches this CPU run cannot take: "))
    assert all(word in branches for word in ("nccl", "autocast", "fp8", "latents", "fused")), branches


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_skips_and_exits_zero():
    proc = _bench("--only", "cache_vs_encoder")
    assert proc.returncode == 0 and proc.stdout.strip() == "no CUDA device: skipped", proc.stdout + proc.stderr


def test_the_benchmark_does_not_import_prefect(tmp_path):
    """The GPU machine has no Prefect: importing the benchmark and its figures' code must not need it."""
    code = (
        "import sys; sys.argv = ['gpu.py']; sys.path.insert(0, 'bench'); import gpu; "
        "import tuneline.stages.train.loop, tuneline.stages.pipeline, tuneline.stages.common.stage; "
        "print('prefect' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout + proc.stderr


@pytest.mark.parametrize("family, layers", [("z_image", 1), ("flux2_klein", 3), ("qwen_image", 1)])
def test_a_shipped_config_without_a_text_encoder_gets_one_of_the_released_width(family, layers, tmp_path):
    """The figures of these families build their text cache with the released encoder's sizes on the tiny
    tokenizer: the features (`layers` hidden states side by side) are as wide as the shipped denoiser takes."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_text import RELEASED, released_config, text_width

    from tuneline.stages.families.registry import get_family
    from tuneline.stages.families.shipped import shipped_dir

    get_family(family).build_tiny(tmp_path)
    cls, cfg = released_config(family, tmp_path)
    text = getattr(cfg, "text_config", cfg)
    assert {k: getattr(text, k) for k in RELEASED[family]} == RELEASED[family]
    assert layers * text.hidden_size == text_width(shipped_dir(family))
    with torch.device("meta"):
        model = cls(cfg)
    assert sum(p.numel() for p in model.parameters()) > 3e9  # a 4 B / 7 B encoder, not the tiny one


def test_a_cache_figure_times_a_build_where_an_earlier_figure_cached(tmp_path):
    """cache_vs_encoder and cache_images_per_s both cache SDXL in the same --work: the second must time a build of
    the latents stage, not the reuse of the first's published cache (a figure of thousands of images per second)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_cache import stage_seconds
    from gpu_setup import Bench

    b = Bench(True, tmp_path, None)
    cfg = b.config("cache-sdxl", "sdxl", images=4)
    _, first = stage_seconds(b, cfg, 4, "once")
    made = json.loads((first.store.latest("latents") / "manifest.json").read_text())["created_at"]
    _, second = stage_seconds(b, cfg, 4, "once")
    assert json.loads((second.store.latest("latents") / "manifest.json").read_text())["created_at"] != made


def test_a_run_of_every_figure_removes_the_models_no_later_figure_builds(tmp_path):
    """Every figure's full-size models together outgrow a GPU machine's disk: after each figure of a run of
    several, the models of families no later figure uses go (a half-written one too); the rest stay."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu

    for family in ("sd15", "sdxl", "flux2_klein", "flux2_klein.tmp", "z_image", "flux"):
        (tmp_path / "models" / family).mkdir(parents=True)
    assert set(gpu.FAMILIES) == set(gpu.FIGURES)
    later = gpu.FIGURES[gpu.FIGURES.index("z_image_lora") :]
    gpu.prune_models(tmp_path, list(later))
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["flux", "sd15", "sdxl", "z_image"]
    gpu.prune_models(tmp_path, [])
    assert list((tmp_path / "models").iterdir()) == []


def test_keep_for_clears_what_earlier_commands_left_before_the_figure(tmp_path, monkeypatch):
    """bench/gpu_session.sh runs each figure as its own command in one --work, passing the figures still to come
    (--keep-for): before the figure the models that neither it nor they build go (an earlier command's); its own
    stay after it for the next command, which removes them first if it has no use for them."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu

    for family in ("sd15", "sdxl", "flux", "z_image"):
        (tmp_path / "models" / family).mkdir(parents=True)
    seen = []
    monkeypatch.setitem(gpu.RUN, "ddp_two_process_cuda", lambda b: seen.append(sorted(os.listdir(b.work / "models"))))
    argv = ["--tiny", "--only", "ddp_two_process_cuda", "--work", str(tmp_path), "--keep-for", "z_image_lora"]
    assert gpu.main(argv) == 0
    assert seen == [["sd15", "z_image"]]  # its own SD1.5 and the next command's Z-Image; SDXL and FLUX.1 gone
    assert sorted(os.listdir(tmp_path / "models")) == ["sd15", "z_image"]
    # The last figure of a run (--keep-for with no names) clears all but its own before it runs.
    assert gpu.main(argv[:-1]) == 0 and seen[-1] == ["sd15"] and os.listdir(tmp_path / "models") == ["sd15"]
    # Without --keep-for, as before, a one-figure command removes nothing.
    (tmp_path / "models" / "sdxl").mkdir()
    assert gpu.main(argv[:-2]) == 0 and seen[-1] == ["sd15", "sdxl"]


def test_in_a_run_of_every_figure_qwen_image_has_the_disk_to_itself():
    """Qwen-Image's folder (~56 GB with its text encoder) fills most of a GPU machine's 64 GiB disk: when its
    figure builds it, pruning has left no other family's models there."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu

    figures = list(gpu.FIGURES)
    on_disk: set[str] = set()
    for i, name in enumerate(figures):
        on_disk |= set(gpu.FAMILIES[name])
        if "qwen_image" in gpu.FAMILIES[name]:
            assert on_disk == {"qwen_image"}, (name, on_disk)
        on_disk &= {family for later in figures[i + 1 :] for family in gpu.FAMILIES[later]}


@pytest.mark.parametrize("declared", [True, False])
def test_the_diffusers_script_gets_cache_latents_only_where_it_declares_it(declared, tmp_path):
    """diffusers' train_dreambooth_lora_sdxl.py has no --cache_latents (argparse would end it at once); the
    comparison passes the flag only to a script that declares it, and otherwise times the VAE encode its steps
    include (sdxl_lora_step_vs_diffusers)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_diffusers import DIFFUSERS_SCRIPT, caches_latents, diffusers_args, script_env
    from gpu_setup import Bench

    script = tmp_path / DIFFUSERS_SCRIPT
    flag = 'parser.add_argument("--cache_latents", action="store_true")\n' if declared else ""
    script.write_text(f'parser.add_argument("--rank", type=int)\n{flag}', encoding="utf-8")
    args = diffusers_args(Bench(True, tmp_path, tmp_path), script, "MODEL", 13, True)
    assert caches_latents(script) is declared
    assert ("--cache_latents" in args) is declared
    assert args[0] == str(script) and "--max_train_steps=13" in args and "--gradient_checkpointing" in args
    # the script opens every file of its instance folder as an image: the captions stay out of it
    (folder,) = [Path(a.split("=", 1)[1]) for a in args if a.startswith("--instance_data_dir=")]
    assert sorted(f.suffix for f in folder.iterdir()) == [".png"] * 8
    # what the script imports beyond the figures' packages sits in the folder's site/, on its path alone
    assert script_env(script).get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    (tmp_path / "site").mkdir()
    assert script_env(script)["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site")


def test_the_gpu_session_script_downloads_the_wheels_the_readme_names():
    """bench/gpu_session.sh's wheels are the versions bench/README.md lists for a bare GPU machine, and the script
    names its modes when called without them."""
    script = (ROOT / "bench" / "gpu_session.sh").read_text(encoding="utf-8")
    readme = " ".join((ROOT / "bench" / "README.md").read_text(encoding="utf-8").split())
    pinned = re.findall(r"([a-z_]+)==([0-9.]+)", script)
    assert {"diffusers", "transformers", "peft", "torchao", "zarr"} <= {name for name, _ in pinned}
    for name, version in pinned:
        if name != "pydantic_core":  # pydantic's exact pin of it; the README says "pydantic ... with pydantic_core"
            assert f"{name} {version}" in readme, (name, version)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh")], capture_output=True, text=True)
    assert proc.returncode != 0 and "wheels DIR | run DIR SECONDS" in proc.stderr


def test_compile_trains_the_timed_figures_compiled_under_their_own_names(tmp_path):
    """--compile: a timed figure's config trains with train.compile and its RESULT line is NAME_compiled; without
    it the figure is eager under its own name."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_setup import Bench

    for compiled in (False, True):
        b = Bench(True, tmp_path, None, compile=compiled)
        name, train = b.timed("z_image_lora_ckpt", {"gradient_checkpointing": True})
        cfg = b.config(name, "sdxl", train)
        assert name == ("z_image_lora_ckpt_compiled" if compiled else "z_image_lora_ckpt")
        assert (cfg.train.compile, cfg.train.gradient_checkpointing) == (compiled, True)
