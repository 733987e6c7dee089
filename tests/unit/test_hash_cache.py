"""The per-user file-hash cache (stages/common/hashing.py HashCache): it outlives every workdir, so it must not
grow with each model folder ever identified, nor be parsed again for each component a run identifies."""

from __future__ import annotations

import json

from tuneline.stages.common import hashing
from tuneline.stages.common.hashing import KEEP_DAYS, HashCache, file_sha256


def _file(path, data: bytes):
    path.write_bytes(data)
    return path


def test_a_save_drops_entries_unused_for_keep_days_and_keeps_the_used_and_the_elsewhere(tmp_path, monkeypatch):
    used, unused, new = (_file(tmp_path / n, n.encode()) for n in ("used.bin", "unused.bin", "new.bin"))
    elsewhere = "/another/machine/weights.safetensors"  # a shared home's entry of a file on another machine's disk
    day = 20_000
    monkeypatch.setattr(hashing, "_today", lambda: day)
    cache = HashCache(tmp_path / "cache.json")
    for f in (used, unused):
        cache.sha256(f)
    cache.known[elsewhere] = [7, 7, "e" * 64, day]
    cache.save()
    day += KEEP_DAYS
    again = HashCache(tmp_path / "cache.json")
    assert again.sha256(used) == file_sha256(used)  # re-dated: used today
    again.known[elsewhere][3] = day - 1  # used yesterday, elsewhere
    day += 1
    assert again.sha256(new) == file_sha256(new)
    again.save()
    on_disk = json.loads((tmp_path / "cache.json").read_text(encoding="utf-8"))
    assert sorted(on_disk) == sorted([str(used.resolve()), str(new.resolve()), elsewhere])
    assert on_disk[str(used.resolve())][2:] == [file_sha256(used), day - 1]


def test_an_unchanged_cache_file_is_parsed_once_and_a_rewritten_one_again(tmp_path, monkeypatch):
    f = _file(tmp_path / "w.bin", b"weights")
    path = tmp_path / "cache.json"
    entry = [f.stat().st_size, f.stat().st_mtime_ns, "a" * 64]  # as written before entries were dated
    path.write_text(json.dumps({str(f.resolve()): entry}), "utf-8")
    parsed = []
    real = hashing.json.loads
    monkeypatch.setattr(hashing.json, "loads", lambda text: parsed.append(1) or real(text))
    HashCache(path)
    second = HashCache(path)
    assert len(parsed) == 1
    assert second.sha256(f) == "a" * 64  # the remembered hash, from the one parse
    other = tmp_path / "other.json"  # another process's save: a new file renamed over it
    other.write_text(json.dumps({}), encoding="utf-8")
    other.replace(path)
    assert HashCache(path).sha256(f) == file_sha256(f)
    assert len(parsed) == 2
