"""The pipeline config: one section per stage, loaded from YAML with errors that name the field.

Every rule is a pydantic validator (on a section, or on PipelineConfig for rules across sections,
schemas/checks.py), so `parse_config`, Prefect's UI form and `PipelineConfig.model_validate` refuse the same configs
with the same message. A validated config is frozen: what was checked is what runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from tuneline.schemas import checks
from tuneline.schemas.base import ConfigPath, Strict, is_url
from tuneline.schemas.buckets import BucketConfig
from tuneline.schemas.caption import CaptionConfig
from tuneline.schemas.latents import LatentsConfig
from tuneline.schemas.model import ModelConfig
from tuneline.schemas.ops import OpsConfig
from tuneline.schemas.reference import nearest_key
from tuneline.schemas.scan import DatasetConfig
from tuneline.schemas.text import TextConfig
from tuneline.schemas.train import TrainConfig
from tuneline.schemas.validate import ValidateConfig
from tuneline.schemas.yamlfile import YamlProblem, load_yaml

DEFAULT_WORKDIR = "./tuneline-work"
# Prefect refuses a flow run whose parameters (the config, as JSON) exceed this, only when the run is created.
MAX_CONFIG_BYTES = 512 * 1024


class ConfigError(ValueError):
    """A config the user must fix; the message names the file and field."""


class PipelineConfig(Strict):
    workdir: str = Field(DEFAULT_WORKDIR, description="where artifacts go")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    buckets: BucketConfig = Field(default_factory=BucketConfig)
    latents: LatentsConfig = Field(default_factory=LatentsConfig)
    caption: CaptionConfig = Field(
        default_factory=CaptionConfig,
        description="captions from a vision-language model (the caption stage, on when caption.model is set)",
    )
    text: TextConfig = Field(default_factory=TextConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    ops: OpsConfig = Field(default_factory=OpsConfig, description="deployments, schedule, lock, gc, remote store")

    model_config = Strict.model_config | {"populate_by_name": True}

    @model_validator(mode="before")
    @classmethod
    def _learning_check_on_demo_only(cls, data):
        """validate.learning_check measures the demo's known classes; on other data it would measure nothing, so
        it reads as false there (decided on the input, before validation: a validated config never changes)."""
        if not isinstance(data, dict):
            return data
        dataset, key = data.get("dataset"), "validate" if "validate" in data else "validate_"
        if dataset is not None and not isinstance(dataset, (dict, DatasetConfig)):
            return data  # refused by the field's own validation
        demo = dataset.demo if isinstance(dataset, DatasetConfig) else (dataset or {}).get("demo", False)
        section = data.get(key)
        if demo in (True, "edit", "video") or section is None:
            return data
        if isinstance(section, ValidateConfig):
            return {**data, key: section.model_copy(update={"learning_check": False})}
        if isinstance(section, dict) and section.get("learning_check"):
            return {**data, key: {**section, "learning_check": False}}
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> PipelineConfig:
        problems = checks.problems(self)
        if self.caption.enabled and self.dataset.empty_caption == "reject":
            problems.append(
                "caption.model is set but dataset.empty_caption is reject: the scan would reject the "
                "images without a caption before the caption stage sees them; set dataset.empty_caption "
                "to keep (or unset caption.model)"
            )
        if problems:
            raise ValueError("\n".join(problems))
        size = len(json.dumps(self.dump()))
        if size > MAX_CONFIG_BYTES:
            raise ValueError(
                f"the config is {size:,} bytes as JSON, over the {MAX_CONFIG_BYTES:,} Prefect accepts "
                f"as a flow run's parameters; {_largest_field(self.dump())} holds most of it: shorten "
                f"it"
            )
        return self

    # Paths ---------------------------------------------------------------------------------------
    def workdir_path(self) -> Path:
        """Absolute once loaded (resolve_paths); resolving here too keeps a config built in code usable."""
        return Path(self.workdir).expanduser().resolve()

    def resolve(self, p: str) -> Path:
        """Relative paths in a config resolve against the workdir (docs/design.md)."""
        path = Path(p).expanduser()
        return path if path.is_absolute() else (self.workdir_path() / path)

    def dump(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)


def _largest_field(data, path: str = "") -> str:
    """The key path of the deepest field still holding most of `data`'s JSON size."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    sizes = [(len(json.dumps(v)), f"{path}.{k}" if path else str(k), v) for k, v in items]
    if not sizes:
        return path or "(top level)"
    size, name, value = max(sizes, key=lambda s: s[0])
    return _largest_field(value, name) if size * 2 > len(json.dumps(data)) else (path or "(top level)")


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]).replace("validate_", "validate")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            near = nearest_key(e["loc"])
            msg = (
                f"unknown key: did you mean {loc.rsplit('.', 1)[0] + '.' if '.' in loc else ''}{near}?"
                if near
                else "unknown key"
            )
            msg += " (`tuneline config example` lists every key with what it does)"
        if not loc:  # a rule across sections: its message names every field itself
            lines += [f"  - {line}" for line in msg.splitlines()]
        else:
            lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def resolve_paths(cfg: PipelineConfig, base: Path | None = None) -> PipelineConfig:
    """Every relative path made absolute, once: the workdir against `base` (the directory the command was started
    in), every other path field (marked ConfigPath) against the workdir. Every process of a run (torchrun workers,
    Prefect workers, deployments) then gets the same absolute paths, whatever its own working directory."""
    workdir = _expand(cfg.workdir, "workdir")
    workdir = (workdir if workdir.is_absolute() else (base or Path.cwd()) / workdir).resolve()
    data = cfg.model_dump(by_alias=True)
    data["workdir"] = str(workdir)
    _absolute(cfg, data, workdir)
    out = PipelineConfig.model_validate(data)
    _check_overlap(out)
    return out


# What the pipeline writes inside its workdir: a dataset there would be scanned together with its own outputs.
OUTPUT_DIRS = ("artifacts", ".cache")


def _check_overlap(cfg: PipelineConfig) -> None:
    """Refuse a dataset folder that is the workdir, holds it, or lies in what the pipeline writes (`loss.png`
    and sample grids would be scanned as training images). A dataset elsewhere in the workdir (the demo's
    `demo-data`) is fine."""
    from tuneline.schemas.sources import dataset_sources

    workdir = cfg.workdir_path()
    for src in dataset_sources(cfg):
        if is_url(src.location):  # object storage: nothing the pipeline writes
            continue
        root = src.root.expanduser().resolve()
        if root == workdir or workdir.is_relative_to(root):
            where = "is the workdir" if root == workdir else "contains the workdir"
        elif any(root.is_relative_to(workdir / d) for d in OUTPUT_DIRS):
            where = "lies inside the workdir's outputs"
        else:
            continue
        raise ConfigError(
            f"{src.field} {root} {where} (workdir {workdir}): the scan would read the pipeline's own "
            f"outputs as training images; put the images in a folder of their own, or set workdir "
            f"(or --workdir) to a folder outside {src.field}"
        )


def _expand(value: str, field: str) -> Path:
    try:
        return Path(value).expanduser()
    except RuntimeError:  # ~name of a user this machine does not know
        raise ConfigError(
            f"{field}: {value} starts with the home folder of a user this machine does not know; write the path "
            f"out in full"
        ) from None


def _absolute(model: BaseModel, data: dict, workdir: Path, section: str = "") -> None:
    for name, info in type(model).model_fields.items():
        key = info.alias or name
        value = getattr(model, name)
        marker = next((m for m in info.metadata if isinstance(m, ConfigPath)), None)
        if marker is not None and isinstance(value, str) and value not in marker.keywords and not is_url(value):
            path = _expand(value, section + key)
            data[key] = str(path if path.is_absolute() else workdir / path)
        elif isinstance(value, BaseModel):
            _absolute(value, data[key], workdir, f"{section}{key}.")
        elif isinstance(value, list):
            for item, item_data in zip(value, data[key]):
                if isinstance(item, BaseModel):
                    _absolute(item, item_data, workdir, f"{section}{key}[].")


def parse_config(
    data: dict, source: str = "<config>", workdir: str | None = None, *, resolve: bool = True
) -> PipelineConfig:
    """Validate a config mapping (`workdir` overrides its workdir); with `resolve`, its paths made absolute."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping of sections")
    data = dict(data)
    if workdir is not None:
        data["workdir"] = workdir
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None
    return resolve_paths(cfg) if resolve else cfg


def load_config(path: str | Path | None, workdir: str | None = None) -> PipelineConfig:
    """Load a YAML config; None gives the built-in demo config."""
    if path is None:
        return demo_config(workdir)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist: pass a YAML file (see `tuneline config example`)")
    try:
        data = load_yaml(p.read_text(encoding="utf-8"))  # a safe loader: config content is never executed
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {p} is not valid YAML: {err}") from None
    except YamlProblem as err:
        raise ConfigError(f"invalid config {p}:\n  - {err}") from None
    return parse_config(data or {}, str(p), workdir)


def demo_config(workdir: str | None = None, *, resolve: bool = True) -> PipelineConfig:
    from tuneline.schemas.demo import DEMO_CONFIG

    return parse_config(DEMO_CONFIG, "<built-in demo>", workdir, resolve=resolve)


def example_yaml() -> str:
    """The demo config with its paths as written (relative), so the file works from wherever it is run."""
    cfg = demo_config(resolve=False)
    return yaml.safe_dump(cfg.dump(), sort_keys=False, allow_unicode=True)
