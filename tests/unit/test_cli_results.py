"""The validation grid's artifact: labelled with its prompts, pictures inline, links only to absolute URLs."""

from __future__ import annotations

import json
import re

from PIL import Image

from tuneline.flows.results import grid_markdown, learning_rows
from tuneline.schemas.config import demo_config

PROMPTS = ["a red square", "a cat | a dog"]


def _validate_dir(tmp_path, controls: bool = False):
    path = tmp_path / "validate" / "abc123"
    path.mkdir(parents=True)
    images = []
    for i, (prompt, color) in enumerate(zip(PROMPTS, ("red", "blue"))):
        Image.new("RGB", (64, 64), color).save(path / f"{i:03d}-seed{i}.png")
        Image.new("RGB", (64, 64), "white").save(path / f"{i:03d}-control.png")
        images.append({"file": f"{i:03d}-seed{i}.png", "prompt": prompt, "negative_prompt": "blurry", "seed": i})
    Image.new("RGB", (128, 64), "gray").save(path / "grid.png")
    m = {"images": images, "grid": "grid.png"} | (
        {"controls": ["000-control.png", "001-control.png"]} if controls else {}
    )
    (path / "manifest.json").write_text(json.dumps(m))
    return path, m


def test_grid_rows_carry_their_prompts_and_inline_tiles_and_no_relative_links(tmp_path):
    path, m = _validate_dir(tmp_path)
    text = grid_markdown(demo_config(str(tmp_path / "w")), path, m)
    assert text.startswith("![grid](data:image/png;base64,")
    assert "| image | prompt | negative prompt | seed |" in text
    assert "| ![000-seed0.png](data:image/png;base64," in text and "| a red square | blurry | 0 |" in text
    assert "a cat &#124; a dog" in text  # a prompt's `|` stays inside its cell (markdown.text)
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links and all(target.startswith("data:image/png;base64,") for target in links), links
    assert "file://" not in text and str(path) not in text


def test_with_a_report_url_tiles_and_grid_link_to_it(tmp_path):
    path, m = _validate_dir(tmp_path)
    cfg = demo_config(str(tmp_path / "w")).model_copy(
        update={"ops": demo_config().ops.model_copy(update={"report_url": "https://files.example/art"})}
    )
    text = grid_markdown(cfg, path, m)
    assert "[full size](https://files.example/art/validate/abc123/grid.png)" in text
    assert "](https://files.example/art/validate/abc123/001-seed1.png)" in text


def test_edit_rows_show_control_result_and_instruction(tmp_path):
    path, m = _validate_dir(tmp_path, controls=True)
    text = grid_markdown(demo_config(str(tmp_path / "w")), path, m)
    assert "| control | result | instruction | seed |" in text
    assert re.search(
        r"\| !\[000-control.png\]\(data:[^)]+\) \| !\[000-seed0.png\]\(data:[^)]+\) \| a red square \| 0 \|", text
    )


def test_learning_rows_name_the_final_loss_and_trained_vs_untrained():
    rows = learning_rows(0.02512, {"color_accuracy": 1.0, "untrained_color_accuracy": 0.28})
    assert rows[0] == {
        "figure": "final loss (training loss, mean of the last 10 steps)",
        "trained": 0.0251,
        "untrained": "",
    }
    assert {"figure": "color_accuracy", "trained": 1.0, "untrained": 0.28} in rows
