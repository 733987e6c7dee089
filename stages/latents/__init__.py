"""Latents stage: VAE latent cache in Zarr, built in a single process before any training starts.

Its version hashes the stage config, the size policy, the VAE identity (config + weights), the code version
and the scan version, so a change to any of them makes the cache stale; rows whose content did not change
are copied from the previous version instead of being encoded again (stages/latents/reuse.py).
"""

from __future__ import annotations

from dataclasses import fields

from tuneline.schemas.families import facts
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ScanManifest
from tuneline.stages.common.artifacts import ArtifactError
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.sizing import size_policy as make_policy
from tuneline.stages.common.stage import StageDef, built_by
from tuneline.stages.families import resolve as models

CODE_VERSION = code_version("latents")  # stages/code_versions.json


def size_policy(cfg) -> dict:
    """The size policy in force: part of the stage's version and recorded in its manifest."""
    policy = make_policy(cfg.buckets, facts(cfg.model.family).alignment)
    # Float fields as floats: a default of 64 and a YAML value of 64.0 must give one version.
    out = {f.name: float(v) if f.type == "float" else v for f in fields(policy) for v in [getattr(policy, f.name)]}
    return out | {"crop": cfg.buckets.crop, "crop_seed": cfg.buckets.seed}


def _config(cfg) -> dict:
    # batch_size, workers and shards change how fast the cache is built, not what it holds.
    # The size policy is not keyed here: it acts through the scan's records (bucket, crop), which are the scan's
    # version, so a policy change that moves no record rebuilds nothing.
    return {
        "latents": cfg.latents.model_dump(mode="json", exclude={"workers", "batch_size", "shards"}),
        "model": cfg.model.model_dump(mode="json", include={"family", "dtype"}),
    }


def _inputs(ctx, upstream) -> dict:
    return {"vae": models.identity(ctx, "vae")}


def _check(ctx, upstream: dict) -> None:
    """Before loading any weights: every scan bucket must be a whole number of latent pixels."""
    fam = models.family(ctx.cfg)
    scan: ScanManifest = upstream["scan"]
    bad = [
        f"{b.width}x{b.height}"
        for b in scan.buckets
        if b.width % fam.facts.vae_factor or b.height % fam.facts.vae_factor
    ]
    if bad:
        raise ArtifactError(
            f"scan {scan.fingerprint} has buckets {', '.join(bad[:5])} that are not multiples of "
            f"the {fam.facts.name} VAE factor {fam.facts.vae_factor}: set buckets.alignment to a "
            f"multiple of it (or null) and run `tuneline stage scan`"
        )


STAGE = StageDef(
    name="latents",
    upstream=("scan",),
    code_version=CODE_VERSION,
    manifest_cls=LatentsManifest,
    config=_config,
    inputs=_inputs,
    build=built_by("tuneline.stages.latents.core"),
    check=_check,
)
