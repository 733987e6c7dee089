"""Train stage: DDP or FSDP training (torchrun; gloo on CPU, NCCL on CUDA) reading only the caches."""

from __future__ import annotations

from tuneline.schemas.sources import training_settings
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.stages.common.artifacts import ArtifactError
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.hashing import file_sha256
from tuneline.stages.common.stage import StageDef, built_by
from tuneline.stages.families import resolve as models

CODE_VERSION = code_version("train")  # stages/code_versions.json


# What changes where, how fast, or how observably a run computes, but not the weights it reaches: left out of the
# fingerprint, so changing them (or resuming with `latest`) keeps a run's partial directory and its checkpoints.
NOT_FINGERPRINTED = {
    "threads_per_process",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_id",
    "resume",
    "checkpoint_every",
    "checkpoint_minutes",
    "keep_checkpoints",
    "validate_every",
    "blocks_to_swap",
    "compile",  # the same steps as eager up to float reordering; leaving it out keeps existing runs' fingerprints
    "fsdp_cpu_offload",
}


def _config(cfg) -> dict:
    # World size sets the global batch, so `processes` and `nodes` are fingerprinted.
    train = cfg.train.model_dump(mode="json", exclude=NOT_FINGERPRINTED)
    if train["parallelism"] == "ddp":  # the default hashes as before FSDP existed: DDP runs stay fresh
        del train["parallelism"]
    if train.get("eval") and train["eval"]["path"]:
        train["eval"]["path"] = True  # the folder's content is the scan's; its location changes nothing
    settings = training_settings(cfg)
    if len(settings) > 1 or cfg.dataset.sources is not None:  # repeats, roles and loss weights shape training
        train["sources"] = settings
    # The model by content (the denoiser's identity in the inputs), not by where it lies.
    return {
        "train": train,
        "model": cfg.model.model_dump(mode="json", include={"family", "dtype", "prediction_type", "quantize"}),
    }


def _inputs(ctx, upstream: dict[str, str]) -> dict:
    out = {"denoiser": models.identity(ctx, "denoiser")}
    if ctx.cfg.train.init_from == "previous":
        # The weights a run continues from are an input like the base model: a newer source is a new run.
        source = init_source(ctx.store, upstream)
        out["init_from"] = source.name if source else "base"
    resume = ctx.cfg.train.resume
    if resume not in (None, "latest", "auto"):
        # Continuing from another run's checkpoint makes a different result than this run's own history.
        state = ctx.cfg.resolve(resume) / "state.json"
        out["resume"] = file_sha256(state) if state.is_file() else f"missing: {state}"
    return out


def init_source(store, upstream: dict[str, str]):
    """With train.init_from previous: the newest published full fine-tune trained on other data than
    `upstream` (a rerun on the same data must not stack on itself), or None."""
    for path in reversed(store.versions("train")):
        try:
            m = store.read(path, TrainManifest)
        except ArtifactError:
            continue
        if m.mode == "full" and m.upstream != upstream:
            return path
    return None


def _check(ctx, upstream) -> None:
    lat, txt = upstream["latents"], upstream["text"]
    if lat.upstream.get("scan") != txt.upstream.get("scan"):
        # Latents and captions from different scans would pair images with the wrong captions. The one that does
        # not name the current scan is wrong (its manifest was edited or copied in): rebuild that one.
        scan = ctx.cache.get("expected", {}).get("scan")
        culprits = [m.stage for m in (lat, txt) if m.upstream.get("scan") != scan] or ["latents", "text"]
        fix = " and ".join(f"`tuneline stage {c} --force`" for c in culprits)
        raise ArtifactError(
            f"latents {lat.fingerprint} was built from scan {lat.upstream.get('scan')} but text "
            f"{txt.fingerprint} from scan {txt.upstream.get('scan')} (the current scan is {scan}); "
            f"run {fix} to rebuild from the current scan"
        )
    fam = models.family(ctx.cfg)
    if lat.family != fam.facts.name or lat.latent_channels != fam.facts.latent_channels:
        raise ArtifactError(
            f"latents {lat.fingerprint} holds {lat.latent_channels}-channel {lat.family} latents, "
            f"model.family {fam.facts.name} needs {fam.facts.latent_channels}; run "
            f"`tuneline stage latents --force`"
        )
    # Open the cache the way every rank will (index, shapes, dtypes, chunking) so a damaged one is refused here,
    # with the reader's message, before any training process starts.
    from tuneline.stages.latents.reader import LatentReader, ReaderError

    try:
        LatentReader(models.artifact_dir(ctx, lat), lat)
    except (ReaderError, ValueError) as err:
        raise ArtifactError(str(err)) from None


STAGE = StageDef(
    name="train",
    upstream=("latents", "text"),
    code_version=CODE_VERSION,
    manifest_cls=TrainManifest,
    config=_config,
    inputs=_inputs,
    build=built_by("tuneline.stages.train.launch"),
    check=_check,
    optional_upstream=("caption",),
)
