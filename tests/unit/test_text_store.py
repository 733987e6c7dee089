"""The text cache's storage and read side on synthetic tensors: chunked writes, dtypes, lazy reads, refusals."""

from __future__ import annotations

import pytest
import torch

from tuneline.stages.common.jsonl import write_jsonl
from tuneline.stages.text import store
from tuneline.stages.text.store import INDEX, STORE, STRINGS, ArrayWriter, TextCache


def _write(tmp_path, rows: int, batch: int, chunk_bytes: int, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(store, "CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(0)
    data = {
        "prompt_embeds": torch.randn(rows, 3, 4, generator=gen),
        "prompt_attention_mask": torch.randint(0, 2, (rows, 3), generator=gen),
        "flags": torch.rand(rows, 2, generator=gen) > 0.5,
    }
    writer = ArrayWriter(tmp_path / STORE, rows)
    for start in range(0, rows, batch):
        writer.add({k: v[start : start + batch] for k, v in data.items()})
    fields = writer.close()
    assert fields == {
        "prompt_embeds": {"shape": (3, 4), "dtype": "float32"},
        "prompt_attention_mask": {"shape": (3,), "dtype": "int64"},
        "flags": {"shape": (2,), "dtype": "bool"},
    }
    write_jsonl(tmp_path / STRINGS, ({"row": i, "text": f"s{i}"} for i in range(rows)))
    # Two variants per caption; caption c<i> uses rows i and i+1, the empty caption row 0 for both.
    write_jsonl(
        tmp_path / INDEX,
        [{"caption": "", "rows": [0, 0]}] + [{"caption": f"c{i}", "rows": [i, i + 1]} for i in range(1, rows - 1)],
    )
    return data


@pytest.mark.parametrize("batch,chunk_bytes", [(4, 48 * 5), (7, 48 * 3), (32, 1 << 20), (1, 1)])
def test_rows_survive_any_batch_and_chunk_size(tmp_path, monkeypatch, batch, chunk_bytes):
    data = _write(tmp_path, 13, batch, chunk_bytes, monkeypatch)
    cache = TextCache(tmp_path, list(data))
    got = cache.get(["c3", "", "c1"], variant_ids=[1, 1, 0])
    for k, v in data.items():
        assert got[k].dtype == v.dtype
        assert torch.equal(got[k], v[[4, 0, 1]]), k


def test_lazy_reads_match_memory(tmp_path, monkeypatch):
    data = _write(tmp_path, 13, 5, 48 * 4, monkeypatch)
    memory = TextCache(tmp_path, list(data))
    lazy = TextCache(tmp_path, list(data), memory_limit=0)
    assert isinstance(memory.arrays["prompt_embeds"], torch.Tensor)
    assert not isinstance(lazy.arrays["prompt_embeds"], torch.Tensor)
    captions, ids = ["c5", "c2", "c5", "", "c11"], [1, 0, 1, 1, 1]
    a, b = memory.get(captions, ids), lazy.get(captions, ids)
    for k in data:
        assert torch.equal(a[k], b[k]), k


def test_get_without_variants_is_variant_zero(tmp_path, monkeypatch):
    data = _write(tmp_path, 6, 6, 1 << 20, monkeypatch)
    cache = TextCache(tmp_path, ["prompt_embeds"])
    assert cache.variants == 2
    assert torch.equal(cache.get(["c2", ""])["prompt_embeds"], data["prompt_embeds"][[2, 0]])
    assert set(cache.get(["c2"])) == {"prompt_embeds"}, "only the fields asked for are read"


def test_refusals_name_the_problem(tmp_path, monkeypatch):
    _write(tmp_path, 6, 6, 1 << 20, monkeypatch)
    cache = TextCache(tmp_path, ["prompt_embeds"])
    with pytest.raises(KeyError, match="caption not in the text cache.*'nope'.*tuneline stage text"):
        cache.get(["c1", "nope"])
    with pytest.raises(IndexError, match="caption variant 2 out of range.*holds 2"):
        cache.get(["c1"], variant_ids=[2])
    with pytest.raises(ValueError, match="2 variant ids for 1 captions"):
        cache.get(["c1"], variant_ids=[0, 1])
    with pytest.raises(ValueError, match="no field 'pooled_prompt_embeds'"):
        TextCache(tmp_path, ["pooled_prompt_embeds"])
    with pytest.raises(ValueError, match="text.enabled false"):
        TextCache(tmp_path / "elsewhere", ["prompt_embeds"])


def test_writer_refuses_a_changing_output(tmp_path):
    writer = ArrayWriter(tmp_path / STORE, 4)
    writer.add({"prompt_embeds": torch.zeros(2, 3)})
    with pytest.raises(RuntimeError, match="changed mid-run at row 2"):
        writer.add({"prompt_embeds": torch.zeros(2, 4)})
    with pytest.raises(RuntimeError, match="changed mid-run"):
        writer.add({"prompt_embeds": torch.zeros(2, 3), "extra": torch.zeros(2, 1)})
    with pytest.raises(RuntimeError, match="holds 2 rows, expected 4"):
        writer.close()


def test_a_short_array_is_refused(tmp_path, monkeypatch):
    _write(tmp_path, 6, 6, 1 << 20, monkeypatch)
    write_jsonl(tmp_path / INDEX, [{"caption": "", "rows": [0, 0]}, {"caption": "x", "rows": [9, 9]}])
    with pytest.raises(ValueError, match="fewer rows than its index names"):
        TextCache(tmp_path, ["prompt_embeds"])
