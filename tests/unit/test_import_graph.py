"""Dependencies point one way. From the bottom:

    schemas            config and manifest models, family facts (pure data)
    stages.common      artifact store, hashing, locks, sizing: no family or stage code
    stages.families    model family adapters (loading, layouts, text encoding)
    stages.render      what training and validation share to look at a model (renderer, prompt cache, plots)
    stage packages     scan, caption, latents, text, train, validate
    stages             the pipeline's definition
    flows              Prefect flows and the CLI

A module imports its own package and the layers below it. A stage imports a sibling stage only to read that stage's
artifact, through the modules in ARTIFACT_READERS (stages.render, below the stages, imports none). Absolute and
relative imports both count, at module level and inside functions; imports under `if TYPE_CHECKING:` (annotations
only) do not. Private zarr modules are never imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"schemas": "tuneline.schemas", "stages": "tuneline.stages", "flows": "tuneline.flows"}
STAGES = ("scan", "caption", "latents", "text", "train", "validate")
RANK = {"schemas": 0, "common": 1, "families": 2, "render": 3, "stage": 4, "stages": 5, "flows": 6}
# The public reading side of each stage's artifact: how another stage reads what it published.
ARTIFACT_READERS = {
    "tuneline.stages.scan.images",  # decode an image the scan recorded, as the scan decoded it
    "tuneline.stages.scan.members",  # read a shard member's or a table cell's bytes by the scan's record
    "tuneline.stages.scan.video",  # decode a clip's frames the scan recorded, as the scan measured them
    "tuneline.stages.scan.masks",  # where the scan's mask images are
    "tuneline.stages.scan.controls",  # where the scan's control images are (paired datasets)
    "tuneline.stages.scan.edit_demo",  # the edit demo's pairs: its learning check draws new controls alike
    "tuneline.stages.scan.video_demo",  # the video demo's captions: its learning check prompts every direction alike
    "tuneline.stages.caption",  # the stage definition and its captions by image (text, train, validate read them)
    "tuneline.stages.latents",  # the stage definition
    "tuneline.stages.latents.reader",
    "tuneline.stages.latents.store",
    "tuneline.stages.latents.masks",
    "tuneline.stages.latents.controls",  # the cached control latents of a paired dataset
    "tuneline.stages.text",  # the stage definition and the embedding length it caches at
    "tuneline.stages.text.store",
    "tuneline.stages.text.live",  # text.enabled false: the same interface, encoded on the fly
    "tuneline.stages.train.export",  # which file of final/ holds the weights
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> tuple[str, str]:
    """(layer, package) of a tuneline module: the package is what counts as "its own"."""
    parts = module.split(".")
    top = parts[1]
    if top in ("schemas", "flows"):
        return top, top
    sub = parts[2] if len(parts) > 2 else ""
    if sub in ("common", "families", "render"):
        return sub, sub
    if sub in STAGES:
        return "stage", sub
    return "stages", "stages"


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno))
            # `from tuneline.stages.latents import store` imports the module tuneline.stages.latents.store
            out += [(f"{target}.{a.name}", node.lineno) for a in node.names if _is_module(f"{target}.{a.name}")]
    return out


def _is_module(name: str) -> bool:
    if not name.startswith("tuneline."):
        return False
    parts = name.split(".")
    rel = Path(ROOT, {v: k for k, v in PACKAGES.items()}[".".join(parts[:2])], *parts[2:])
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def problem(importer: str, imported: str) -> str | None:
    if not imported.startswith("tuneline."):
        return None
    (la, pa), (lb, pb) = layer(importer), layer(imported)
    if pa == pb or RANK[lb] < RANK[la] and lb != "stage":
        return None
    if lb == "stage" and RANK[la] >= RANK["stage"] and imported in ARTIFACT_READERS:
        return None
    if lb == "stage" and RANK[la] > RANK["stage"]:
        return None  # the pipeline and flows use the stages
    return f"{importer} ({la}) imports {imported} ({lb})"


def sources() -> list[Path]:
    return sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py"))


def test_no_upward_or_sibling_imports():
    found = [
        f"{p.relative_to(ROOT)}:{line}: {why}"
        for p in sources()
        for target, line in imports(p)
        if (why := problem(module_name(p), target))
    ]
    assert not found, "imports against the layering (tests/unit/test_import_graph.py says why):\n" + "\n".join(found)


def test_no_private_zarr_modules():
    bad = [
        f"{p.relative_to(ROOT)}:{line}: {target}"
        for p in sources()
        for target, line in imports(p)
        if target.startswith("zarr.")
        and (
            target.split(".")[1] in ("core", "codecs", "abc") or any(part.startswith("_") for part in target.split("."))
        )
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_catches_each_kind_of_wrong_import(tmp_path):
    """The rules above, on imports the tree must not have (so a regression would be caught)."""
    assert problem("tuneline.stages.common.sizing", "tuneline.stages.families.base")  # upward
    assert problem("tuneline.schemas.config", "tuneline.stages.common.stage")  # upward from the bottom
    assert problem("tuneline.stages.train.hooks", "tuneline.stages.validate.core")  # sibling stage, not a reader
    assert problem("tuneline.stages.families.base", "tuneline.stages.render.renderer")  # upward
    assert problem("tuneline.stages.render.renderer", "tuneline.stages.validate.core")  # not a reader
    assert problem("tuneline.stages.render.renderer", "tuneline.stages.train.export")  # a reader, but render is below
    assert not problem("tuneline.stages.train.loop", "tuneline.stages.latents.reader")  # reads latents' artifact
    assert not problem("tuneline.stages.validate.core", "tuneline.stages.render.renderer")
    assert not problem("tuneline.flows.cli", "tuneline.stages.scan.demo")
    relative = tmp_path / "stages" / "common"
    relative.mkdir(parents=True)
    (relative / "x.py").write_text(
        "from ..families import base\nfrom . import sizing\n\n\ndef f():\n    from tuneline.stages.train import export\n"
    )
    global ROOT
    real, ROOT = ROOT, tmp_path
    try:
        found = imports(relative / "x.py")
    finally:
        ROOT = real
    assert ("tuneline.stages.families", 1) in found and ("tuneline.stages.common", 2) in found
    assert ("tuneline.stages.train", 6) in found  # inside a function
