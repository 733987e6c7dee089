"""Config values that used to pass load and fail minutes later are refused at load, naming the field, before
anything is written; and every way a config is built refuses the same configs with the same message."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from tuneline.schemas.config import MAX_CONFIG_BYTES, ConfigError, PipelineConfig, load_config, parse_config
from tuneline.schemas.demo import DEMO_CONFIG


def demo(**sections) -> dict:
    data = copy.deepcopy(DEMO_CONFIG)
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return data


def refused_file(tmp_path, text: str, *fields: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, workdir=str(tmp_path / "work"))
    msg = str(info.value)
    for f in fields:
        assert f in msg, f"{f!r} not named in:\n{msg}"
    assert not (tmp_path / "work").exists()  # nothing written
    return msg


@pytest.mark.parametrize(
    "field, value",
    [
        (f, ".inf")
        for f in (
            "train.learning_rate",
            "train.noise_offset",
            "train.weight_decay",
            "buckets.resolution",
            "validate.aspect",
            "train.checkpoint_minutes",
            "ops.lock_timeout",
            "train.logit_mean",
        )
    ]
    + [("train.logit_mean", ".nan"), ("train.logit_mean", "-.inf")],
)
def test_infinities_and_nan_are_refused_naming_the_field(tmp_path, field, value):
    section, key = field.split(".")
    refused_file(tmp_path, f"{section}:\n  {key}: {value}\n", field)


def test_infinity_inside_a_free_form_mapping_is_refused(tmp_path):
    refused_file(tmp_path, "ops:\n  remote_options:\n    timeouts: [1, .inf]\n", "ops.remote_options.timeouts.1")


@pytest.mark.parametrize(
    "field, value",
    [
        ("buckets.resolution", 1e9),
        ("train.batch_size", 10**9),
        ("train.lora_rank", 10**9),
        ("train.processes", 10000),
        ("latents.batch_size", 10**9),
        ("text.batch_size", 10**9),
        ("train.seed", 2**63),
        ("train.seed", -1),
        ("buckets.seed", 2**64),
        ("validate.aspect", 1e9),
    ],
)
def test_values_past_what_any_machine_holds_are_refused(field, value):
    section, key = field.split(".")
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(demo(**{section: {key: value}}))


def test_a_validation_prompt_seed_past_64_bits_is_refused():
    with pytest.raises(ConfigError, match=r"validate\.prompts\.0\.seed"):
        parse_config(demo(validate={"prompts": [{"prompt": "a", "seed": 2**64}]}))


@pytest.mark.parametrize(
    "field, value",
    [
        ("train.steps", True),
        ("train.batch_size", "8"),
        ("train.processes", 2.0),
        ("train.learning_rate", True),
        ("train.ema", "yes"),
    ],
)
def test_values_of_the_wrong_type_are_not_coerced(field, value):
    section, key = field.split(".")
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(demo(**{section: {key: value}}))


def test_the_background_colour_still_reads_from_a_yaml_list():
    cfg = parse_config(demo(dataset={"background": [0, 0, 0]}))
    assert cfg.dataset.background == (0, 0, 0)


def test_a_key_written_twice_is_refused(tmp_path):
    msg = refused_file(tmp_path, "train:\n  steps: 10\n  steps: 20\n", "'steps'", "lines 2 and 3")
    assert "appears twice" in msg


def test_a_section_written_twice_is_refused(tmp_path):
    refused_file(
        tmp_path, "train:\n  steps: 10\nmodel:\n  family: tiny\ntrain:\n  lora_rank: 4\n", "'train'", "lines 1 and 5"
    )


def test_an_alias_bomb_is_refused_without_expanding_it(tmp_path):
    lines = ["ops:", "  remote_options:", "    l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"    l{i}: &l{i} [*l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, "
        f"*l{i - 1}, *l{i - 1}, *l{i - 1}]"
        for i in range(1, 9)
    ]  # 10**9 strings once expanded
    msg = refused_file(tmp_path, "\n".join(lines) + "\n", "ops.remote_options.l8", "alias")
    assert len(msg) < 1000


def test_aliases_of_modest_size_still_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("validate:\n  prompts:\n    - &p {prompt: a cat, seed: 1}\n    - *p\n", encoding="utf-8")
    cfg = load_config(path, workdir=str(tmp_path / "work"))
    assert [p.prompt for p in cfg.validate_.prompts] == ["a cat", "a cat"]


def test_a_config_over_prefects_parameter_limit_is_refused():
    prompts = [{"prompt": "x" * 1000, "seed": i} for i in range(MAX_CONFIG_BYTES // 1000 + 10)]
    with pytest.raises(ConfigError, match=r"validate\.prompts.*shorten") as info:
        parse_config(demo(validate={"prompts": prompts}))
    assert len(str(info.value)) < 1000  # the message does not echo the config


def test_the_cli_refuses_before_writing_anything(tmp_path):
    (tmp_path / "c.yaml").write_text("workdir: work\ntrain:\n  processes: 10000\n", encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "-m", "tuneline.flows.cli", "status", "c.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "train.processes" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr and not (tmp_path / "work").exists()


# ---- one rule, one message, whichever way the config is built -------------------------------------

CROSS_FIELD = [
    ({"model": {"family": "flux"}, "train": {"loss_weighting": "min_snr"}}, "train.loss_weighting min_snr"),
    ({"model": {"dtype": "float16", "device": "cpu"}}, "model.dtype float16"),
    ({"train": {"masked_loss": True}}, "train.masked_loss"),
    ({"buckets": {"resolution": 2}}, "buckets.resolution 2"),
]


@pytest.mark.parametrize("sections, rule", CROSS_FIELD)
def test_model_validate_refuses_what_parse_config_refuses_with_the_same_message(sections, rule):
    data = demo(**sections)
    with pytest.raises(ConfigError) as parsed:
        parse_config(data)
    with pytest.raises(ValidationError) as validated:
        PipelineConfig.model_validate(data)
    problem = next(line for line in str(parsed.value).splitlines() if rule in line).removeprefix("  - ")
    assert problem in str(validated.value)
    assert problem in str(validated.value.errors()[0]["msg"])


def test_a_validated_config_is_frozen():
    cfg = parse_config(demo())
    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.steps = 5  # type: ignore[misc]
    assert cfg.train.steps == DEMO_CONFIG["train"]["steps"]


def test_learning_check_reads_as_false_off_the_demo_without_changing_a_validated_config():
    off_demo = demo(dataset={"demo": False, "path": "/data"})
    cfg = PipelineConfig.model_validate(off_demo)
    assert cfg.validate_.learning_check is False
    assert parse_config(off_demo).dump()["validate"] == cfg.dump()["validate"]
    assert json.loads(json.dumps(parse_config(demo()).dump()))["validate"]["learning_check"] is True
