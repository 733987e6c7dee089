"""Scan stage: dataset config, per-image records, the scan manifest (bucketing config: schemas/buckets.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tuneline.schemas.base import ConfigPath, Manifest, StorageOptions, Strict, is_url

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif")
# Always listed beside the images: a video family trains on them, an image family rejects them with a reason.
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")
# The record fields of a clip (stages/scan/video.py); null on the records of an image family.
CLIP_FIELDS = ("frames", "fps", "start", "end", "source_frames", "source_fps")
# PIL's own refusal threshold (2 x Image.MAX_IMAGE_PIXELS): above it PIL refuses before we could decide.
PIL_BOMB_LIMIT = 178_956_970
Channel = Annotated[int, Field(ge=0, le=255)]
SourceFormat = Literal["folder", "webdataset", "parquet"]
# dataset.masks / dataset.control (or a source's control): a webdataset sample's own mask / control members.
MEMBERS = "members"
FORMAT_DOC = (
    "folder (image files + captions), webdataset (.tar shards: key.jpg + key.txt / key.json) or parquet "
    "(an image column of bytes or {bytes, path} structs + a caption column); null = detected from the path"
)
STORAGE_DOC = (
    "non-secret fsspec options for an s3:// / gs:// / az:// path (e.g. {endpoint_url: http://minio:9000}); "
    "credentials come from the environment (AWS_* variables, or TUNELINE_REMOTE_OPTIONS as JSON)"
)


class SourceConfig(Strict):
    """One folder of a dataset made of several (dataset.sources)."""

    path: Annotated[str, ConfigPath()] = Field(
        description="folder of images (+ captions); relative paths resolve against the workdir"
    )
    repeats: int = Field(1, ge=1, description="times each image is seen per epoch")
    role: Literal["train", "regularization"] = Field(
        "train", description="regularization: prior-preservation images (class images), trained with loss_weight"
    )
    loss_weight: float = Field(1.0, gt=0, description="multiplies the loss of this source's samples")
    caption_extension: str | None = Field(
        None, description="sidecar caption extension of this folder; null = dataset.caption_extension"
    )
    control: Annotated[str | None, ConfigPath(keywords=(MEMBERS,))] = Field(
        None,
        description="this folder's control (input) images, paired as dataset.control pairs them (`members`: a "
        "webdataset source's key.control.<ext> members); null = dataset.control",
    )
    format: SourceFormat | None = Field(None, description=FORMAT_DOC)
    storage_options: StorageOptions = Field(default_factory=dict, description=STORAGE_DOC)

    @field_validator("caption_extension")
    @classmethod
    def _caption_extension(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("."):
            raise ValueError(f"{v!r} must start with '.', e.g. .txt")
        return v


class DatasetConfig(Strict):
    path: Annotated[str | None, ConfigPath()] = Field(
        "demo-data",
        description="folder of images (+ captions); relative paths resolve against the workdir. "
        "null when dataset.sources lists the folders",
    )
    sources: list[SourceConfig] | None = Field(
        None,
        min_length=1,
        description="several folders, each with its repeats, role (train | regularization), "
        "loss_weight and caption_extension; dataset.path must then be null",
    )
    format: SourceFormat | None = Field(None, description=FORMAT_DOC)
    image_column: str = Field("image", min_length=1, description="parquet: the column holding each image's bytes")
    caption_column: str = Field("caption", min_length=1, description="parquet: the column holding each caption")
    storage_options: StorageOptions = Field(default_factory=dict, description=STORAGE_DOC)
    demo: bool | Literal["edit", "video"] = Field(
        False,
        description="write the demo's generated dataset to `path` first; `edit`: pairs of shapes whose instruction "
        'changes the color ("make it red"), the controls in dataset.control (null: `<path>-controls`); `video` '
        '(a video family): clips of a colored square whose caption names its motion ("a red square moving left")',
    )
    caption_extension: str = Field(".txt", description="sidecar caption file extension")
    recursive: bool = True
    extensions: list[str] = Field(
        list(IMAGE_EXTENSIONS), min_length=1, description="image file extensions scanned (case-insensitive)"
    )
    metadata_file: str = Field(
        "metadata.jsonl",
        description="HF imagefolder captions: one JSON object per line "
        "with `file_name` (relative to the metadata file's folder) and a caption field",
    )
    metadata_caption_field: str | None = Field(
        None, description="caption field in metadata_file; null = the first of text, caption, prompt present"
    )
    empty_caption: Literal["keep", "reject", "filename"] = Field(
        "keep",
        description="missing/empty caption: keep it empty (unconditional sample), reject the image, "
        "or caption it from its file name",
    )
    background: tuple[Channel, Channel, Channel] = Field(
        (255, 255, 255), strict=False, description="RGB (0-255) that transparent pixels are composited on"
    )
    max_image_pixels: int = Field(
        89_478_485, ge=1, le=PIL_BOMB_LIMIT, description="decompression-bomb guard: larger images are rejected unread"
    )
    duplicates: Literal["keep", "reject"] = Field(
        "keep",
        description="images with identical content are always "
        "reported; `reject` keeps only the first path of each group",
    )
    masks: Annotated[str | None, ConfigPath(keywords=("alpha", MEMBERS))] = Field(
        None,
        description="loss masks (train.masked_loss): `alpha` = each image's alpha channel, `members` = a "
        "webdataset sample's key.mask.<ext> member, or a folder of "
        "mask images matched by file stem (white = train, black = ignore; same size as the "
        "image; relative: against the workdir); images without one weigh fully. null = none",
    )

    control: Annotated[str | None, ConfigPath(keywords=(MEMBERS,))] = Field(
        None,
        description="paired (editing) datasets: a folder of control (input) images, one per image, matched by "
        "path without extension (cat.png -> <control>/cat.png, any image extension; relative: against the "
        "workdir), or several references as <control>/cat/*.png (sorted by name) for families that take several "
        "(FLUX.2 [dev] and [klein], Qwen-Image-Edit Plus); `members`: a webdataset sample's key.control.<ext> "
        "member. The caption is the edit instruction; an image without its control is rejected. "
        "With dataset.sources, a source's own `control` replaces it for that source. null = none",
    )

    @model_validator(mode="before")
    @classmethod
    def _edit_demo_controls(cls, data):
        """The edit demo writes its controls beside its images unless dataset.control names a folder."""
        if isinstance(data, dict) and data.get("demo") == "edit" and not data.get("control") and data.get("path"):
            return {**data, "control": f"{str(data['path']).rstrip('/')}-controls"}
        return data

    @model_validator(mode="after")
    def _one_dataset(self) -> DatasetConfig:
        if self.sources is not None and self.path is not None:
            raise ValueError(
                f"dataset.path ({self.path}) and dataset.sources are exclusive: set dataset.path to "
                f"null to train on the sources, or remove dataset.sources"
            )
        if self.sources is None and self.path is None:
            raise ValueError(
                "dataset.path is null and dataset.sources is not set: give a folder in dataset.path "
                "or a list in dataset.sources"
            )
        if self.sources is not None and not any(s.role == "train" for s in self.sources):
            raise ValueError(
                "dataset.sources has no source with role train: regularization images only "
                "preserve a prior, something must be trained"
            )
        if self.demo and self.path is None:
            raise ValueError(
                "dataset.demo writes the demo dataset to dataset.path: set dataset.path, or "
                "dataset.demo false with dataset.sources"
            )
        return self

    @field_validator("control")
    @classmethod
    def _control(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("give a folder of control images, or null")
        return v

    @field_validator("masks")
    @classmethod
    def _masks(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("use alpha, a folder of mask images, or null")
        return v

    @field_validator("extensions")
    @classmethod
    def _extensions(cls, v: list[str]) -> list[str]:
        bad = [e for e in v if e.lower() not in IMAGE_EXTENSIONS]
        if bad:
            raise ValueError(f"{bad} not supported; choose from {list(IMAGE_EXTENSIONS)}")
        return v

    @field_validator("caption_extension")
    @classmethod
    def _caption_extension(cls, v: str) -> str:
        if not v.startswith("."):
            raise ValueError(f"{v!r} must start with '.', e.g. .txt")
        return v


class ControlFile(BaseModel):
    """One reference image of a target that has several (<control>/<stem>/*.png)."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="relative to the control folder, '/' separated")
    sha256: str
    size_bytes: int
    width: int = Field(description="after EXIF orientation (resized to the image's size when cached)")
    height: int


# Where a webdataset / parquet record's bytes are (null on a folder's records).
MEMBER_FIELDS = ("shard", "offset", "row_group", "row", "column")
# Where a webdataset record's mask and control members are (null unless dataset.masks / control is `members`).
PART_FIELDS = ("mask_offset", "mask_size_bytes", "control_offset")


class ImageRecord(BaseModel):
    """One accepted image, as every later stage sees it. Sizes come from the ONE size function.

    width/height are after EXIF orientation; `load_rgb(path, record)` reproduces exactly that image.
    """

    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="relative to the dataset root, '/' separated")
    width: int
    height: int
    bucket_width: int
    bucket_height: int
    crop: tuple[int, int, int, int] = Field(
        description="left, top, right, bottom in oriented original pixels; "
        "this region is resized to the bucket (SDXL crop conditioning)"
    )
    caption: str
    caption_source: Literal["sidecar", "metadata", "filename", "none"] = "none"
    sha256: str
    size_bytes: int
    mtime_ns: int
    format: str = ""
    mode: str = Field("RGB", description="PIL mode of the file")
    orientation: int = Field(1, ge=1, le=8, description="EXIF orientation applied (1 = none)")
    conversion: str = Field("", description="how the file's mode becomes RGB, empty when it already is")
    background: tuple[int, int, int] | None = Field(None, description="RGB transparent pixels are composited on")
    trailer: int = Field(
        0,
        ge=0,
        description="bytes after the image's end marker (a phone's Motion Photo video, "
        "an editor's appended data): kept in the file, never decoded; 0 when none",
    )
    resolution: float | None = Field(
        None,
        description="the buckets.resolutions entry this record is sized for "
        "(one record per image and resolution); null without buckets.resolutions",
    )
    mask_kind: Literal["alpha", "file", "member"] | None = Field(
        None, description="where the loss mask comes from, if any (member: the sample's key.mask.<ext> member)"
    )
    mask_path: str | None = Field(
        None, description="mask file relative to dataset.masks (mask_kind file); the mask member's path (member)"
    )
    mask_sha256: str | None = Field(None, description="content of the mask file, so a changed mask is new content")
    control_path: str | None = Field(None, description="control image relative to dataset.control (paired data)")
    control_sha256: str | None = Field(
        None, description="content of the control image: a changed control is new content"
    )
    control_size_bytes: int | None = None
    control_width: int | None = Field(None, description="control size after EXIF orientation (resized to the image's)")
    control_height: int | None = None
    control_references: list[ControlFile] | None = Field(
        None,
        description="several references (<control>/<stem>/*.png, sorted by name): each file; control_path is then "
        "the folder and control_sha256 covers every reference's content. null: one control file",
    )
    frames: int | None = Field(
        None, ge=1, description="video families: frames as trained (the family's rule, Wan: 4k+1; an image: 1)"
    )
    fps: float | None = Field(None, description="video families: the frame rate the clip is trained at")
    start: float | None = Field(None, ge=0, description="video families: where the clip starts in the file (s)")
    end: float | None = Field(None, ge=0, description="video families: where the clip ends in the file (s)")
    source_frames: int | None = Field(None, description="video families: the file's frame count (its header's)")
    source_fps: float | None = Field(None, description="video families: the file's frame rate")
    source: int | None = Field(
        None,
        description="with dataset.sources or train.eval.path: the index of the "
        "folder `path` is relative to (dataset.sources in order, then train.eval.path); "
        "null for a plain dataset.path",
    )
    shard: str | None = Field(
        None, description="webdataset/parquet: the .tar or .parquet file holding the image, relative to its source"
    )
    offset: int | None = Field(None, description="webdataset: byte offset of the image member's data in the shard")
    row_group: int | None = Field(None, description="parquet: the row group holding the image")
    row: int | None = Field(None, description="parquet: the image's row within its row group")
    column: str | None = Field(None, description="parquet: the column the image's bytes are read from")
    mask_offset: int | None = Field(None, description="webdataset: byte offset of the mask member's data")
    mask_size_bytes: int | None = Field(None, description="webdataset: size of the mask member")
    control_offset: int | None = Field(
        None, description="webdataset: byte offset of the control member's data (control_path: the member's path)"
    )

    @property
    def ref(self) -> str:
        """The record's name among all sources: its path, prefixed by its source index when it has one (a
        relative path never holds '//', so two sources' identical paths stay apart). A clip's ends with its time
        range as a media fragment (`#t=start,end`): buckets.clip every cuts one file into several clips."""
        name = self.path if self.source is None else f"{self.source}//{self.path}"
        return name if self.start is None else f"{name}#t={self.start:g},{self.end:g}"


class Rejected(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    reason: str = Field(description="what is wrong and what to do about it")
    kind: str = Field("other", description="short category, counted in the manifest's rejected_by_kind")


class BucketRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int
    height: int
    frames: int | None = Field(None, description="video families: the bucket's frame count")
    count: int
    samples: list[str] = Field(default_factory=list)
    dropped: bool = Field(False, description="fewer images than one batch with buckets.small_bucket drop")


class SourceRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(description="the folder, absolute")
    role: Literal["train", "regularization", "eval"]
    images: int = Field(description="records from this folder")
    control: str | None = Field(None, description="its control folder, absolute (paired data); null = none")


class ScanManifest(Manifest):
    stage: Literal["scan"] = "scan"
    alignment: int
    dataset_root: str
    accepted: int
    rejected: int
    buckets: list[BucketRow]
    duplicates: list[list[str]] = Field(default_factory=list, description="groups of paths with identical bytes")
    rejected_by_kind: dict[str, int] = Field(default_factory=dict)
    conversions: dict[str, int] = Field(default_factory=dict, description="mode conversion -> image count")
    reopened: int = Field(0, description="image files read in this build (the rest reused the previous scan)")
    sources: list[SourceRow] = Field(
        default_factory=list,
        description="with dataset.sources or train.eval.path: each folder by record `source` index",
    )
    control_root: str | None = Field(None, description="dataset.control, absolute; null without paired data")
    unmatched_controls: list[str] = Field(
        default_factory=list, description="control images (relative to control_root) no image pairs with"
    )
    storage_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="fsspec URL of a source -> its non-secret storage options"
    )
    shards_read: list[str] = Field(
        default_factory=list,
        description="webdataset/parquet files indexed by this build (the rest reused the previous scan's index)",
    )
    shard_listing: dict[str, dict[str, list[str]]] = Field(
        default_factory=dict,
        description="webdataset/parquet sources: location -> {shard: [identity, digest of what the scan read from "
        "it]} as this build listed them, so `tuneline status` names the shards added, replaced and removed since",
    )

    def roots(self) -> dict[int | None, Path | Location]:
        """record.source -> the folder its path is relative to (a Location for an fsspec URL)."""
        where = {None: self.dataset_root, **{i: s.root for i, s in enumerate(self.sources)}}
        return {k: Location(v, self.storage_options.get(v, {})) if is_url(v) else Path(v) for k, v in where.items()}

    def control_roots(self) -> dict[int | None, Path | None]:
        """record.source -> the folder its control_path is relative to (None: that folder has no controls)."""
        plain = None if self.control_root is None else Path(self.control_root)
        return {None: plain, **{i: Path(s.control) if s.control else None for i, s in enumerate(self.sources)}}

    def control_sources(self) -> dict[int | None, Path | Location]:
        """record.source -> where its controls are read: its control folder, or for a source without one (whose
        records pair with their samples' control members, `control_offset`) the source itself."""
        images = self.roots()
        return {k: folder if folder is not None else images[k] for k, folder in self.control_roots().items()}


@dataclass(frozen=True)
class Location:
    """A source that is an fsspec URL (s3://bucket/prefix): where its shards are read from, and how."""

    url: str
    options: dict[str, Any] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return self.url
