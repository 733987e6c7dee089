"""Train stage: DDP training (torchrun; gloo on CPU, NCCL on CUDA) reading only the caches."""
from __future__ import annotations

from schemas.train import TrainManifest
from stages.common import models
from stages.common.artifacts import ArtifactError
from stages.common.stage import StageDef

CODE_VERSION = "train-1"


def _config(cfg) -> dict:
    # World size sets the global batch, so `processes` and `nodes` are fingerprinted; thread counts and
    # rendezvous addresses change where and how fast it runs, not what it computes.
    train = cfg.train.model_dump(mode="json", exclude={"threads_per_process", "node_rank", "rdzv_endpoint",
                                                       "rdzv_id"})
    return {"train": train, "model": cfg.model.model_dump(mode="json", include={"family", "path"})}


def _inputs(ctx) -> dict:
    return {"denoiser": models.identity(ctx, "denoiser")}


def _check(ctx, upstream) -> None:
    lat, txt = upstream["latents"], upstream["text"]
    if lat.upstream.get("scan") != txt.upstream.get("scan"):
        # Latents and captions from different scans would pair images with the wrong captions.
        raise ArtifactError(f"latents {lat.fingerprint} was built from scan {lat.upstream.get('scan')} but text "
                            f"{txt.fingerprint} from scan {txt.upstream.get('scan')}; run `tuneline run` to rebuild "
                            f"both from the current scan")
    fam = models.family(ctx.cfg)
    if lat.family != fam.facts.name or lat.latent_channels != fam.facts.latent_channels:
        raise ArtifactError(f"latents {lat.fingerprint} holds {lat.latent_channels}-channel {lat.family} latents, "
                            f"model.family {fam.facts.name} needs {fam.facts.latent_channels}; run "
                            f"`tuneline stage latents --force`")


def _build(ctx, work, upstream):
    from stages.train.launch import build

    return build(ctx, work, upstream)


STAGE = StageDef(name="train", upstream=("latents", "text"), code_version=CODE_VERSION,
                 manifest_cls=TrainManifest, config=_config, inputs=_inputs, build=_build, check=_check)
