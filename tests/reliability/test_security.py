"""Security: nothing unpickles or evaluates untrusted data; paths from manifests, scan records, captions and
metadata cannot leave the workdir or the dataset root; a config is data, never code; server auth is documented."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from tests.reliability.faultlib import ROOT, cli_args

SOURCE_DIRS = ("flows", "stages", "schemas", "bench", "infra", "tests")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "shelve", "marshal", "joblib", "cloudpickle"}


def _sources() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT)) for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts
    )


def _kw(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_calls(source: str) -> list[str]:
    """Findings in one file: unsafe deserialisers, dynamic code execution, shell-interpreted commands."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"line {node.lineno}: imports {m}" for m in mods if m.split(".")[0] in UNSAFE_MODULES]
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        where = f"line {node.lineno}: {owner + '.' if owner else ''}{name}("
        if isinstance(f, ast.Name) and name in ("eval", "exec", "compile", "__import__"):
            found.append(where + " executes dynamic code")
        elif owner == "torch" and name == "load" and not _is_const(_kw(node, "weights_only"), True):
            found.append(where + " without weights_only=True unpickles arbitrary objects")
        elif owner == "yaml" and name in ("load", "load_all"):
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if not (isinstance(loader, ast.Attribute) and loader.attr in ("SafeLoader", "CSafeLoader")):
                found.append(where + " without SafeLoader constructs arbitrary Python objects")
        elif owner == "yaml" and name in ("unsafe_load", "full_load", "unsafe_load_all", "full_load_all"):
            found.append(where + " constructs Python objects")
        elif owner in ("np", "numpy") and name == "load" and _is_const(_kw(node, "allow_pickle"), True):
            found.append(where + " allow_pickle=True")
        elif owner == "os" and name in ("system", "popen"):
            found.append(where + " runs a shell")
        elif _is_const(_kw(node, "shell"), True):
            found.append(where + " shell=True")
    return found


def test_scanner_finds_what_it_looks_for():
    bad = (
        "import pickle\ntorch.load(f)\ntorch.load(f, weights_only=False)\nyaml.load(s)\neval(x)\nexec(y)\n"
        "yaml.load(s, Loader=yaml.Loader)\nsubprocess.run(c, shell=True)\nos.system(c)\n"
    )
    assert len(unsafe_calls(bad)) == 9, unsafe_calls(bad)
    good = (
        "torch.load(f, weights_only=True)\nyaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\n"
        "model.eval()\nsubprocess.run([a, b])\n"
    )
    assert unsafe_calls(good) == []


@pytest.mark.parametrize("path", _sources())
def test_source_has_no_unsafe_deserialisation_or_eval(path):
    assert unsafe_calls((ROOT / path).read_text(encoding="utf-8")) == []


# Config content is data ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "payload",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
        "!!python/name:os.system",
    ],
)
def test_yaml_python_tags_are_refused_and_never_run(tmp_path, payload):
    marker = tmp_path / "pwned"
    (tmp_path / "evil.yaml").write_text(f"train:\n  steps: {payload.format(marker=marker)}\n", encoding="utf-8")
    for command in ("run", "status"):
        out = subprocess.run(
            cli_args(command, str(tmp_path / "evil.yaml"), "--workdir", str(tmp_path / "w")),
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert out.returncode == 1 and "evil.yaml" in out.stderr, out.stderr[-1000:]
        assert not marker.exists(), "config content was executed"
        assert not (tmp_path / "w").exists()


# Paths from artifacts and datasets -------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["../../../../../../etc/passwd", "/etc/passwd", "a/../../../outside.txt"])
def test_manifest_file_entry_cannot_escape_the_artifact(tmp_path, entry):
    from tuneline.schemas.base import Manifest
    from tuneline.stages.common.artifacts import ArtifactError, ArtifactStore, manifest_digest

    art = _fake_artifact(tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    m["files"].append({"path": entry, "bytes": 1, "sha256": "0" * 64})
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="does not match its own digest"):
        ArtifactStore(tmp_path / "w").read(art, Manifest)
    # Even a forger who recomputes the digest cannot make the store read outside the artifact.
    m["digest"] = manifest_digest(m)
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="outside"):
        ArtifactStore(tmp_path / "w").read(art, Manifest)


def test_symlink_inside_an_artifact_cannot_point_outside(tmp_path):
    from tuneline.schemas.base import Manifest
    from tuneline.stages.common.artifacts import ArtifactError, ArtifactStore

    art = _fake_artifact(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("x" * 5)
    (art / "data.txt").unlink()
    (art / "data.txt").symlink_to(outside)
    with pytest.raises(ArtifactError, match="outside"):
        ArtifactStore(tmp_path / "w").read(art, Manifest)


def _fake_artifact(tmp_path: Path) -> Path:
    """A minimal published artifact that verifies, built through the store's own publish."""
    from tuneline.schemas.base import Manifest
    from tuneline.stages.common.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "w")
    work = store.start("text", "feedbeeffeedbeef")
    (work / "data.txt").write_text("hello")
    path = store.publish(
        work, Manifest(stage="text", fingerprint="feedbeeffeedbeef", tool_version="t", code_version="c")
    )
    store.read(path, Manifest)
    return path


def test_scan_record_path_cannot_leave_the_dataset_root(tmp_path):
    """A scan record (images.jsonl) naming ../ or an absolute path: latents refuses it, never reads the file."""
    from tests.records import image_record
    from tuneline.stages.common.artifacts import ArtifactError
    from tuneline.stages.latents.encode import prepare

    root, secret = tmp_path / "data", tmp_path / "secret.png"
    root.mkdir()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(secret)
    for rel in ("../secret.png", str(secret), "sub/../../secret.png"):
        rec = image_record(rel, (64, 64), secret)
        try:
            result = prepare(root, rec)
        except ArtifactError as err:
            assert "outside" in str(err)
            continue
        assert isinstance(result, str), f"{rel}: pixels were read from outside the dataset root"


def test_captions_and_metadata_cannot_reach_outside_the_dataset_root(tmp_path):
    from tuneline.schemas.config import parse_config
    from tuneline.stages.common.stage import StageContext, run_stage
    from tuneline.stages.pipeline import PIPELINE, stage

    root, outside = tmp_path / "data", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("TOP-SECRET caption", encoding="utf-8")
    Image.new("RGB", (64, 64), (200, 10, 10)).save(outside / "far.png")
    for i in range(3):
        Image.new("RGB", (64, 64), (i * 40, 90, 90)).save(root / f"img{i}.png")
    (root / "img0.txt").symlink_to(outside / "secret.txt")
    (root / "metadata.jsonl").write_text(
        json.dumps({"file_name": "../outside/far.png", "text": "far"})
        + "\n"
        + json.dumps({"file_name": "img1.png", "text": "one"})
        + "\n"
    )
    cfg = parse_config({"workdir": str(tmp_path / "w"), "dataset": {"path": str(root), "demo": False}})
    path, _ = run_stage(StageContext(cfg), stage("scan"), PIPELINE)
    text = (path / "images.jsonl").read_text(encoding="utf-8")
    assert "TOP-SECRET" not in text and "far.png" not in text
    assert {json.loads(line)["path"] for line in text.splitlines()} <= {"img0.png", "img1.png", "img2.png"}


# Server auth -----------------------------------------------------------------------------------------------
def test_prefect_server_auth_is_documented():
    docs = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert "PREFECT_SERVER_API_AUTH_STRING" in docs, "the server's side of basic auth is not documented"
    assert "PREFECT_API_AUTH_STRING=" in docs, "clients' side of basic auth is not documented"
