"""One import package: an install provides `tuneline` (tuneline.flows, tuneline.stages, tuneline.schemas) from
the repository's top-level folders, and nothing imports them by their bare names (two copies of a module would
break exception matching and registries)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("flows", "stages", "schemas")
BARE = re.compile(r"^\s*(from|import)\s+(flows|stages|schemas)\b", re.M)
BARE_MODULE_ARG = re.compile(r"""["'](-m)["'],\s*["'](flows|stages|schemas)\.""")


def _sources() -> list[Path]:
    skip = {".venv", ".git", "build", "dist"}
    return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def test_no_module_imports_the_bare_top_level_names():
    offenders = [
        f"{p.relative_to(ROOT)}: {m.group(0).strip()}"
        for p in _sources()
        for m in BARE.finditer(p.read_text(encoding="utf-8"))
    ]
    offenders += [
        f"{p.relative_to(ROOT)}: -m {m.group(2)}."
        for p in _sources()
        for m in BARE_MODULE_ARG.finditer(p.read_text(encoding="utf-8"))
    ]
    assert not offenders, "import these as tuneline.<name>:\n" + "\n".join(offenders)


def test_packages_are_discovered_not_listed():
    """A new folder (a family's) ships without a pyproject.toml line: setup.py discovers the packages, pyproject.toml
    only maps the three folders into tuneline (the wheel test below checks what ships)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert "packages" not in setuptools
    assert setuptools["package-dir"] == {f"tuneline.{t}": t for t in TOP}


def _shipped_sources() -> set[str]:
    """Every file the wheel must hold: each package's modules and every data file under the three folders (configs,
    docs, the demo VAE), at its tuneline path."""
    out = set()
    for top in TOP:
        for p in (ROOT / top).rglob("*"):
            if not p.is_file() or "__pycache__" in p.parts or p.suffix == ".pyc":
                continue
            if p.suffix == ".py" and not (p.parent / "__init__.py").exists():
                continue  # a script beside data (stages/families/configs/derive.py), not a module
            out.add("tuneline/" + p.relative_to(ROOT).as_posix())
    return out


def test_a_wheel_holds_only_the_tuneline_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("tuneline-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"tuneline", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    names = set(zipfile.ZipFile(wheel).namelist())
    assert sorted(_shipped_sources() - names) == []
    assert "tuneline/stages/families/tiny/assets/demo_vae.safetensors" in names
    assert "tuneline/stages/families/configs/sdxl/unet/config.json" in names


def test_outside_the_repository_only_tuneline_imports(tmp_path):
    code = (
        "import importlib.util as u; import tuneline.stages.common.jsonl; "
        "print([n for n in ('stages', 'flows', 'schemas') if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "[]"
