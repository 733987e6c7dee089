"""The training reader straight from S3-compatible storage (loopback moto server): same batches as read locally."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.test_s3_remote import BUCKET, CREDS, s3  # noqa: F401  (s3: the moto server fixture)
from tests.unit.test_latents_reader import make_cache
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.common.prefetch import ahead
from tuneline.stages.common.remote import Remote, RemoteError, read_remote_manifest
from tuneline.stages.latents import store
from tuneline.stages.latents.reader import LatentReader, ReaderError

VERSION = "0123456789abcdef"


def _publish_and_push(workdir: Path, endpoint: str, prefix: str) -> tuple[Remote, LatentsManifest, Path]:
    """A tiny flip cache, written as the stage writes it, published locally and pushed to s3://BUCKET/prefix."""
    artifacts = ArtifactStore(workdir)
    work = artifacts.start("latents", VERSION)
    manifest, _ = make_cache(work, flip=True)
    local = artifacts.publish(work, manifest.model_copy(update={"fingerprint": VERSION}))
    # Credentials straight in the options: the test has no environment to keep them out of a config.
    remote = Remote(f"s3://{BUCKET}/{prefix}", {"endpoint_url": endpoint, **CREDS})
    assert remote.push(artifacts, "latents", VERSION)
    return remote, artifacts.read(local, LatentsManifest, full=True), local


def _epoch(reader: LatentReader) -> list[torch.Tensor]:
    """One epoch's latents, every other row of a batch flipped, read by two threads as the training feed reads a
    remote cache (several GETs in flight)."""
    batches = [reader.batch(b, rows, flip=np.arange(len(rows)) % 2 == 1) for b, rows in reader.plan(3, 2, 11, 0)]
    return list(
        ahead(
            enumerate(batches),
            lambda ib: reader.sample(ib[1], torch.Generator().manual_seed(ib[0])),
            workers=2,
            depth=3,
        )
    )


def test_reader_on_the_s3_url_samples_what_the_local_reader_samples(tmp_path, s3):  # noqa: F811
    remote, local_manifest, local = _publish_and_push(tmp_path, s3, "reader")
    url = remote.version_url("latents", VERSION)
    manifest = read_remote_manifest(url, LatentsManifest, remote.options)
    assert manifest == local_manifest
    reader = LatentReader(url, manifest, storage_options=remote.options)
    assert all(
        not a.local and str(a.where).startswith(url) for arrays in reader.arrays.values() for a in arrays.values()
    )
    local_reader = LatentReader(local, local_manifest)
    assert reader.counts() == local_reader.counts() and reader.paths == local_reader.paths
    remote_epoch, local_epoch = _epoch(reader), _epoch(local_reader)
    assert len(remote_epoch) == len(local_reader.plan(3, 2, 11, 0)) > 3
    assert all(torch.equal(r, loc) for r, loc in zip(remote_epoch, local_epoch, strict=True))
    batch = reader.batch("96x64", np.array([8, 0, 4]))
    assert torch.equal(
        reader.sample(batch, torch.Generator().manual_seed(3)),
        local_reader.sample(batch, torch.Generator().manual_seed(3)),
    )


def test_a_remote_version_edited_after_its_push_is_refused_naming_the_url(tmp_path, s3):  # noqa: F811
    remote, manifest, _ = _publish_and_push(tmp_path, s3, "edited")
    url = remote.version_url("latents", VERSION)
    reader = LatentReader(url, manifest, storage_options=remote.options)  # opened before the edit
    rel = f"{store.STORE}/64x64/mean/c/1/0/0/0"
    key = f"{BUCKET}/edited/latents/{VERSION}/{rel}"
    remote.fs.pipe_file(key, remote.fs.cat_file(key)[:-2])
    with pytest.raises(RemoteError, match=rf"{re.escape(url)}: file {re.escape(rel)} has \d+ bytes, its manifest"):
        read_remote_manifest(url, LatentsManifest, remote.options)
    with pytest.raises(ReaderError, match=rf"block 1: chunk file {re.escape(url)}/{re.escape(rel)} .*\(truncated"):
        reader.gather(reader.batch("64x64", np.array([5])))
    remote.fs.rm_file(key.replace("/mean/c/1/", "/std/c/2/"))  # a missing chunk must not read as zeros
    with pytest.raises(ReaderError, match=r"block 2: chunk object s3://\S+/std/c/2/0/0/0 is missing"):
        reader.gather(reader.batch("64x64", np.array([9])))
    with pytest.raises(RemoteError, match=rf"{re.escape(url)}0 has no manifest.json"):
        read_remote_manifest(f"{url}0", LatentsManifest, remote.options)
