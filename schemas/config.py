"""The pipeline config: one section per stage, loaded from YAML with errors that name the field."""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from tuneline.schemas.base import ConfigPath, Strict
from tuneline.schemas.latents import LatentsConfig
from tuneline.schemas.model import ModelConfig
from tuneline.schemas.ops import OpsConfig
from tuneline.schemas.scan import BucketConfig, DatasetConfig
from tuneline.schemas.text import TextConfig
from tuneline.schemas.train import TrainConfig
from tuneline.schemas.validate import ValidateConfig

DEFAULT_WORKDIR = "./tuneline-work"


class ConfigError(ValueError):
    """A config the user must fix; the message names the file and field."""


class PipelineConfig(Strict):
    workdir: str = Field(DEFAULT_WORKDIR, description="where artifacts go")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    buckets: BucketConfig = Field(default_factory=BucketConfig)
    latents: LatentsConfig = Field(default_factory=LatentsConfig)
    text: TextConfig = Field(default_factory=TextConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    ops: OpsConfig = Field(default_factory=OpsConfig, description="deployments, schedule, lock, gc, remote store")

    model_config = Strict.model_config | {"populate_by_name": True}

    @model_validator(mode="after")
    def _cross_checks(self) -> "PipelineConfig":
        if self.validate_.learning_check and not self.dataset.demo:
            # The check needs the demo's known classes; on other data it would measure nothing.
            object.__setattr__(self.validate_, "learning_check", False)
        if self.model.dtype == "float16" and self.model.device == "cpu":
            raise ValueError("model.dtype float16 is not supported with model.device cpu: use float32 or bfloat16")
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


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if x != "validate_") or "(top level)"
        loc = loc.replace("validate_", "validate")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `tuneline config schema` lists every key)"
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def resolve_paths(cfg: PipelineConfig, base: Path | None = None) -> PipelineConfig:
    """Every relative path made absolute, once: the workdir against `base` (the directory the command was started
    in), every other path field (marked ConfigPath) against the workdir. Every process of a run (torchrun workers,
    Prefect workers, deployments) then gets the same absolute paths, whatever its own working directory."""
    workdir = Path(cfg.workdir).expanduser()
    workdir = (workdir if workdir.is_absolute() else (base or Path.cwd()) / workdir).resolve()
    data = cfg.model_dump(by_alias=True)
    data["workdir"] = str(workdir)
    _absolute(cfg, data, workdir)
    return PipelineConfig.model_validate(data)


def _absolute(model: BaseModel, data: dict, workdir: Path) -> None:
    for name, info in type(model).model_fields.items():
        key = info.alias or name
        value = getattr(model, name)
        marker = next((m for m in info.metadata if isinstance(m, ConfigPath)), None)
        if marker is not None and isinstance(value, str) and value not in marker.keywords:
            path = Path(value).expanduser()
            data[key] = str(path if path.is_absolute() else workdir / path)
        elif isinstance(value, BaseModel):
            _absolute(value, data[key], workdir)
        elif isinstance(value, list):
            for item, item_data in zip(value, data[key]):
                if isinstance(item, BaseModel):
                    _absolute(item, item_data, workdir)


def parse_config(data: dict, source: str = "<config>", workdir: str | None = None, *,
                 resolve: bool = True) -> PipelineConfig:
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
    from tuneline.schemas.checks import check_config  # family-aware checks live beside the registry facts

    if resolve:
        cfg = resolve_paths(cfg)
    check_config(cfg, source)
    return cfg


def load_config(path: str | Path | None, workdir: str | None = None) -> PipelineConfig:
    """Load a YAML config; None gives the built-in demo config."""
    if path is None:
        return demo_config(workdir)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist: pass a YAML file (see `tuneline config example`)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))  # safe_load: config content is never executed
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {p} is not valid YAML: {err}") from None
    return parse_config(data or {}, str(p), workdir)


def demo_config(workdir: str | None = None, *, resolve: bool = True) -> PipelineConfig:
    from tuneline.schemas.demo import DEMO_CONFIG

    return parse_config(DEMO_CONFIG, "<built-in demo>", workdir, resolve=resolve)


def example_yaml() -> str:
    """The demo config with its paths as written (relative), so the file works from wherever it is run."""
    cfg = demo_config(resolve=False)
    return yaml.safe_dump(cfg.dump(), sort_keys=False, allow_unicode=True)
