"""A family is one folder: no code outside stages/families/<name>/ names a family, except its registry line and its
row in schemas/families.py or schemas/families_wan.py (docs, config examples, the shipped configs' data and tests aside)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tuneline.schemas.families import FAMILY_FACTS
from tuneline.stages.common import codeident
from tuneline.stages.families.registry import family_names, get_family

ROOT = Path(__file__).resolve().parents[2]
# Config examples (the demo's config) and the shipped weightless configs with their derivation script.
# caption.model: tiny names the tiny vision-language model of the caption stage, not the tiny family.
ASIDE = {"schemas/demo.py", "schemas/caption.py", "stages/caption/__init__.py", "stages/caption/tiny.py"}
ASIDE_DIRS = ("stages/families/configs/",)
IMPORT = re.compile(r"tuneline\.stages\.families\.(\w+)")


def _pattern(name: str) -> re.Pattern:
    # "tiny" is also a word ("a tiny VAE"): only the quoted name counts; the others count as words (lower case).
    return re.compile(rf"[\"']{name}[\"']") if name == "tiny" else re.compile(rf"(?<![\w.-]){name}(?![\w-])")


# The tables of family rows: schemas/families.py, which takes in the Wan video families' rows.
ROW_FILES = ("schemas/families.py", "schemas/families_wan.py")


def _rows() -> dict[str, tuple[str, range]]:
    """Each family's row: its table's file and line numbers (from its key to the next key or the table's end)."""
    out = {}
    for rel in ROW_FILES:
        lines = (ROOT / rel).read_text(encoding="utf-8").splitlines()
        starts = {n: i for i, line in enumerate(lines) for n in FAMILY_FACTS if line.startswith(f'    "{n}": ')}
        end = next(i for i, line in enumerate(lines) if i > max(starts.values()) and line == "}")
        bounds = sorted(starts.values()) + [end]
        out |= {n: (rel, range(i, bounds[bounds.index(i) + 1])) for n, i in starts.items()}
    return out


def _offences(root: Path = ROOT) -> list[str]:
    rows, out = _rows(), []
    files = [p for d in ("stages", "schemas", "flows") for p in (root / d).rglob("*.py")]
    for f in sorted(files):
        rel = f.relative_to(root).as_posix()
        if rel in ASIDE or rel.startswith(ASIDE_DIRS):
            continue
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
            for name in FAMILY_FACTS:
                if not _pattern(name).search(line) or rel.startswith(f"stages/families/{name}/"):
                    continue
                if rel == rows[name][0] and i in rows[name][1]:
                    continue
                # another layout's row names the family it is a layout of (FamilyFacts.variant_of)
                if rel in ROW_FILES and line.strip() == f'variant_of="{name}",':
                    continue
                if rel == "stages/families/registry.py" and line.strip().startswith(f'"{name}": '):
                    continue
                # A family folder may build on another's code (hashed with it: codeident.family_files).
                if rel.startswith("stages/families/") and name in IMPORT.findall(line):
                    continue
                out.append(f"{rel}:{i + 1}: {name}: {line.strip()}")
    return out


def test_no_family_is_named_outside_its_folder_registry_line_and_row():
    assert _offences() == []


def test_the_check_sees_a_family_named_in_generic_code(tmp_path):
    # On a copy: a file added to the checkout would change the code versions other test workers are hashing.
    for d in ("stages", "schemas", "flows"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "__pycache__"))
    (tmp_path / "stages" / "families" / "_probe_family_name.py").write_text('IF = "flux"\n', encoding="utf-8")
    assert any(o.startswith("stages/families/_probe_family_name.py:1: flux") for o in _offences(tmp_path))


def test_each_family_is_hashed_apart_and_with_what_it_imports():
    files = {n: {p.relative_to(ROOT).as_posix() for p in codeident.family_files(n)} for n in FAMILY_FACTS}
    for name in FAMILY_FACTS:
        assert any(f.startswith(f"stages/families/{name}/") for f in files[name])
        assert not any(f.startswith("stages/families/") and f.count("/") == 2 for f in files[name])  # generic code
    assert not any("/sdxl/" in f for f in files["sd15"])  # an sdxl edit leaves sd15's caches alone
    assert any(f.startswith("stages/families/sd15/") for f in files["tiny"])  # tiny builds on SD1.5's adapter


def test_a_family_revision_changes_only_its_own_stage_versions(monkeypatch):
    monkeypatch.setattr(codeident, "family_recorded", lambda: {"flux": {"revision": 2}})
    assert codeident.stage_code_version("train", "train-5", "flux") == "train-5+flux-2"
    assert codeident.stage_code_version("train", "train-5", "sd15") == "train-5"
    assert codeident.stage_code_version("scan", "scan-4", "flux") == "scan-4"


def test_family_sources_are_recorded():
    for name in FAMILY_FACTS:
        assert codeident.family_hash(name) == codeident.family_recorded()[name]["source"], (
            f"stages/families/{name}/ changed since it was recorded: run `python -m tuneline.stages.common.codeident "
            f"--bump {name}` if its outputs change (only {name}'s versions become stale), else `--record {name}`"
        )


def _family_expr(node) -> bool:
    """A family object: `fam`/`family`, `<x>.fam`/`<x>.family`, or a call `get_family(...)` / `<x>.family(...)`."""
    import ast

    if isinstance(node, ast.Name):
        return node.id in ("fam", "family")
    if isinstance(node, ast.Attribute):
        return node.attr in ("fam", "family")
    if isinstance(node, ast.Call):
        f = node.func
        return (isinstance(f, ast.Name) and f.id == "get_family") or (
            isinstance(f, ast.Attribute) and f.attr == "family"
        )
    return False


def test_generic_code_reads_family_hooks_as_attributes():
    """Optional family abilities are members of the Family protocol with their default in one base class: code
    reads them, it never probes a family with getattr/hasattr (a probe silently falls back on a misspelt hook)."""
    import ast

    probes = []
    for f in sorted(p for d in ("stages", "flows", "bench", "schemas") for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and _family_expr(node.args[0])
            ):
                probes.append(f"{f.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert probes == [], "family hooks probed with getattr/hasattr (declare them in stages/families/base.py)"


def test_every_family_has_every_protocol_member():
    from tuneline.stages.families.base import Family
    from tuneline.stages.families.registry import family_names, get_family

    members = {n for n in vars(Family).get("__annotations__", {})}
    members |= {n for n, v in vars(Family).items() if callable(v) and not n.startswith("_")}
    assert {"unused_modules", "takes_control", "check_full_finetune", "comfy_lora_state"} <= members
    missing = {n: sorted(m for m in members if not hasattr(get_family(n), m)) for n in family_names()}
    assert not any(missing.values()), missing


def test_each_denoiser_class_is_the_one_its_pipeline_names():
    """facts.denoiser_model, by which training builds the denoiser, is the class the pipeline loads it as."""
    for name in family_names():
        fam = get_family(name)
        named = fam.pipeline_class._get_signature_types()
        for component in (fam.denoiser_component, *(c for c, _ in fam.facts.experts)):
            assert fam.denoiser_class in named[component], (name, component, fam.denoiser_class, named[component])
