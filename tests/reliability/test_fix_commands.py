"""Every refusal names a fix; running that exact command, as printed, from the same directory, leaves the stage
fresh. And the consumer-side checks a manifest's own digest would otherwise shadow: each case edits a fact and
re-computes the digest, so only the consumer's check can catch it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.reliability import faultlib as fl
from tests.reliability.test_tampered import CASES, _version, edited_fact
from tuneline.stages.common.artifacts import manifest_digest

pytestmark = pytest.mark.timeout(2400)

FIX = re.compile(r"`(tuneline [^`]+)`")


def _redigest(path: Path, edit) -> None:
    """Edit a published manifest and give it a matching digest, as a careful forger (or a buggy tool) would."""
    m = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    edit(m)
    m["digest"] = manifest_digest(m)
    (path / "manifest.json").write_text(json.dumps(m, indent=2), encoding="utf-8")


def text_from_another_scan(w: Path) -> tuple[str, str, str]:
    _redigest(_version(w, "text"), lambda m: m["upstream"].update(scan="f" * 16))
    return "text", "train", "from scan ffffffffffffffff"


def channels_mismatch(w: Path) -> tuple[str, str, str]:
    _redigest(_version(w, "latents"), lambda m: m.update(latent_channels=16))
    return "latents", "train", "16-channel"


def family_mismatch(w: Path) -> tuple[str, str, str]:
    _redigest(_version(w, "latents"), lambda m: m.update(family="sd3"))
    return "latents", "train", "sd3 latents"


def index_does_not_fit(w: Path) -> tuple[str, str, str]:
    def edit(m: dict) -> None:
        m["buckets"][0]["count"] += 3
        m["count"] += 3

    _redigest(_version(w, "latents"), edit)
    return "latents", "train", "index lacks"


def block_dtype_mismatch(w: Path) -> tuple[str, str, str]:
    _redigest(_version(w, "latents"), lambda m: m.update(dtype="float32" if m["dtype"] == "float16" else "float16"))
    return "latents", "train", "float"


CONSUMER_CASES = [text_from_another_scan, channels_mismatch, family_mismatch, index_does_not_fit, block_dtype_mismatch]


def _refusal(workdir: Path, config: Path, env: dict, victim: str, consumer: str) -> str:
    """The consumer's refusal, which must name the victim artifact; nothing of the consumer is published."""
    names = [
        str(workdir / "artifacts" / victim),
        f"{victim} artifact",
        *(f"{victim} {v}" for v in fl.published(workdir, victim)),
    ]
    fl.drop_stage(workdir, consumer)  # the consumer must read the victim, not skip as fresh
    out = fl.tuneline("stage", consumer, str(config), "--workdir", str(workdir), env=env)
    assert out.returncode != 0, f"`tuneline stage {consumer}` accepted the tampered {victim} artifact"
    assert "\nerror: " in "\n" + out.stderr, f"no error message for the user:\n{out.stderr[-1500:]}"
    msg = out.stderr[("\n" + out.stderr).rindex("\nerror: ") :]
    assert any(n in msg for n in names), f"message does not name the {victim} artifact: {msg}"
    assert not fl.published(workdir, consumer), f"{consumer} published on top of a tampered {victim}"
    return msg


def _states(workdir: Path, config: Path) -> dict[str, str]:
    """What `tuneline status` computes, in-process (saves a CLI start per case)."""
    from tuneline.schemas.config import load_config
    from tuneline.stages.common.stage import StageContext, status
    from tuneline.stages.pipeline import PIPELINE

    return {r.stage: r.state for r in status(StageContext(load_config(config, str(workdir))), PIPELINE)}


@pytest.mark.parametrize("tamper", [*CASES, *CONSUMER_CASES], ids=lambda c: c.__name__)
def test_the_printed_fix_works_as_printed(workcopy, small_config, prefect_env, tamper):
    victim, consumer, *expected = tamper(workcopy)
    msg = _refusal(workcopy, small_config, prefect_env, victim, consumer)
    if expected:  # a re-digested edit: only the consumer's own check can have caught it
        assert expected[0] in msg, f"the {consumer} stage's check did not catch the edited {victim} manifest: {msg}"
    fixes = FIX.findall(msg)
    assert fixes, f"no command in the refusal: {msg}"
    command = shlex.split(fixes[0])
    assert command[:1] == ["tuneline"] and str(small_config) in command and str(workcopy) in command, (
        f"the fix does not carry the CONFIG and --workdir the user gave: {fixes[0]}"
    )
    out = fl.tuneline(*command[1:], env=prefect_env)
    assert out.returncode == 0, f"`{fixes[0]}` failed:\n{out.stderr[-2000:]}"
    states = _states(workcopy, small_config)
    assert states[victim] == "fresh", f"after `{fixes[0]}` the {victim} stage is {states[victim]}"


def test_run_after_a_tampered_upstream_repairs_it(workcopy, small_config, prefect_env):
    """`tuneline run` rebuilds a version that fails its checks (atomically replacing it) and everything after."""
    edited_fact(workcopy)  # latents' manifest no longer matches its digest
    (_version(workcopy, "text") / "captions.jsonl").write_text("tampered\n", encoding="utf-8")
    out = fl.tuneline("run", str(small_config), "--workdir", str(workcopy), env=prefect_env, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    assert set(_states(workcopy, small_config).values()) == {"fresh"}
    assert not [p for p in (workcopy / "artifacts").glob("*/.*") if p.name.endswith((".old", ".new"))]
