"""Tokenizer files derived from their published sources, for derive.py: the CLIP BPE vocabulary the way openai's
clip/simple_tokenizer.py builds it, and T5's fast Unigram tokenizer.json the way transformers' T5 converter builds it
from spiece.model (read here with a minimal protobuf reader, so neither sentencepiece nor protobuf is needed)."""

from __future__ import annotations

import base64
import gzip
import json
import struct
from pathlib import Path

from tuneline.stages.families.vocab import bytes_to_unicode  # (openai's byte-level alphabet, shared)

N_MERGES = 49152 - 256 - 2  # openai's simple_tokenizer: the merges the released CLIP models use


def clip_bpe(gz: Path) -> tuple[dict[str, int], list[str]]:
    lines = gzip.open(gz).read().decode("utf-8").split("\n")[1 : N_MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    assert all(len(m) == 2 for m in merges), "unexpected merges file"
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}, [" ".join(m) for m in merges]


def _fields(buf: bytes):
    """(field number, value) of one protobuf message: the few wire types a SentencePiece model uses."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        yield key >> 3, value


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        byte = buf[i]
        i += 1
        out |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return out, i


def spm_model(path: Path) -> tuple[list[tuple[str, float, int]], bytes]:
    """(pieces as (text, score, type), the normalizer's precompiled charsmap) of a SentencePiece ModelProto: field 1
    is a repeated SentencePiece {1: piece, 2: score, 3: type}, field 3 the NormalizerSpec {2: precompiled_charsmap}.
    Read without sentencepiece/protobuf so the derivation needs nothing beyond Python."""
    pieces, charsmap = [], b""
    for num, value in _fields(path.read_bytes()):
        if num == 1:
            f = dict(_fields(value))
            pieces.append((f[1].decode("utf-8"), struct.unpack("<f", f.get(2, b"\0" * 4))[0], f.get(3, 1)))
        elif num == 3:
            charsmap = dict(_fields(value)).get(2, b"")
    return pieces, charsmap


T5_EXTRA_IDS = 100  # <extra_id_0..99>: T5's sentinels, ids 32099..32000 (the vocabulary is 32100 = 32000 + 100)


def t5_tokenizer_json(model: Path) -> dict:
    """tokenizer.json of T5's Unigram tokenizer as transformers' T5 converter writes it: the pieces with their
    scores, the SentencePiece normalizer (NFKC charsmap, trailing-space strip, runs of spaces to one), Metaspace
    word marker, `</s>` appended, then the sentinels <extra_id_99> .. <extra_id_0>."""
    pieces, charsmap = spm_model(model)
    assert len(pieces) == 32000 and [p[0] for p in pieces[:3]] == ["<pad>", "</s>", "<unk>"], "not T5's spiece.model"
    extra = [f"<extra_id_{i}>" for i in reversed(range(T5_EXTRA_IDS))]

    def added(i: int, text: str, strip: bool) -> dict:
        return {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": strip,
            "rstrip": strip,
            "normalized": False,
            "special": True,
        }

    meta = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    eos = [{"SpecialToken": {"id": "</s>", "type_id": 0}}]
    seq = [{"Sequence": {"id": "A", "type_id": 0}}]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(i, p[0], False) for i, p in enumerate(pieces[:3])]
        + [added(len(pieces) + i, t, True) for i, t in enumerate(extra)],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode("ascii")},
                {"type": "Strip", "strip_left": False, "strip_right": True},
                {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "\u2581"},
            ],
        },
        "pre_tokenizer": meta,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": seq + eos,
            "pair": seq + eos + [{"Sequence": {"id": "B", "type_id": 0}}] + eos,
            "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}},
        },
        "decoder": meta,
        "model": {
            "type": "Unigram",
            "unk_id": 2,
            "byte_fallback": False,
            "vocab": [[p[0], p[1]] for p in pieces] + [[t, 0.0] for t in extra],
        },
    }


def t5_tokenizer(folder: Path, tok_json: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(
        json.dumps(tok_json, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    specials = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    dump(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "T5Tokenizer",
            "model_max_length": 512,
            "extra_ids": T5_EXTRA_IDS,
            "legacy": True,
            **specials,
        },
    )
    dump(folder / "special_tokens_map.json", specials)


def dump(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer(folder: Path, vocab: dict[str, int], merges: list[str], pad: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(
        json.dumps(vocab, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    dump(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "CLIPTokenizer",
            "model_max_length": 77,
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
            "pad_token": pad,
            "do_lower_case": True,
            "errors": "replace",
            "add_prefix_space": False,
        },
    )
    dump(
        folder / "special_tokens_map.json",
        {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": pad},
    )
