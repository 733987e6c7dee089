"""Building blocks shared by configs and manifests."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class ConfigPath:
    """Marks a config field holding a filesystem path (`Annotated[str | None, ConfigPath()]`): relative values are
    made absolute against the workdir once, when the config is loaded (tuneline.schemas.config.resolve_paths). Values in
    `keywords` are not paths (e.g. train.resume `auto`)."""

    keywords: tuple[str, ...] = ()


def is_url(value: str) -> bool:
    """An fsspec URL (s3://, gs://, file://…): a ConfigPath value that is never resolved against the workdir."""
    return "://" in value


# Configs are recorded in manifests and shown in the Prefect UI: a credential there would be published with them.
SECRET_OPTIONS = ("key", "secret", "token", "password", "credential", "sas", "private")


def _no_secrets(options: dict[str, Any]) -> dict[str, Any]:
    if found := [k for k in options if any(word in k.lower() for word in SECRET_OPTIONS) and k != "key_prefix"]:
        raise ValueError(
            f"{found} look like credentials: configs are recorded in every manifest. Remove them from the config and "
            'set them in the environment instead (AWS_* variables, or TUNELINE_REMOTE_OPTIONS=\'{"key": "...", '
            '"secret": "..."}\')'
        )
    return options


# fsspec storage options kept in a config: endpoint, region, addressing style; never a credential.
StorageOptions = Annotated[dict[str, Any], AfterValidator(_no_secrets)]


class Strict(BaseModel):
    """A config section, refused at load rather than minutes later: unknown keys (a typo is an error, not a silent
    default), values of the wrong type (no `true` read as 1, no "8" read as 8), infinities and NaN. Frozen once
    validated: what was checked is what runs."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# Seeds feed numpy's and torch's generators, which take non-negative 64-bit values.
Seed = Annotated[int, Field(ge=0, lt=2**63, description="random seed, 0 <= seed < 2**63")]
# Values past what any machine holds (a batch of 1e9 samples, a rank-1e9 LoRA) fail minutes later, after the
# scan and caches ran; refusing them at load names the field instead.
MAX_BATCH = 65_536


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="path relative to the artifact directory, '/' separated")
    bytes: int
    sha256: str


MANIFEST_SCHEMA_VERSION = 1


class Manifest(BaseModel):
    """What every published artifact says about itself (docs/design.md: the artifact contract).

    Stage manifests subclass this and add the facts a consumer checks before reading.
    """

    model_config = ConfigDict(extra="forbid")
    schema_version: int = MANIFEST_SCHEMA_VERSION
    stage: str
    fingerprint: str
    upstream: dict[str, str] = Field(default_factory=dict, description="stage -> fingerprint consumed")
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    tool_version: str
    code_version: str
    config: dict = Field(default_factory=dict, description="the effective stage config that was fingerprinted")
    inputs: dict = Field(default_factory=dict, description="input fingerprints (e.g. dataset listing, model identity)")
    files: list[FileEntry] = Field(default_factory=list)
    digest: str = Field("", description="SHA-256 of this manifest without this field, set when published")
