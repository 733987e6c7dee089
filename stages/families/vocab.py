"""Tokenizers for the tiny flavors, built locally because no model hub can be reached.

Both tokenize any ASCII text (CLIP falls back to single bytes, T5 to single characters) and keep whole-word tokens
for a small English vocabulary, so demo captions ("a red square") are a few meaningful tokens each.
Everything here is deterministic: same code, same files, same tokenizer identity.
"""

from __future__ import annotations

import json
import string
from collections import Counter
from pathlib import Path

# Words that become single tokens; the demo's colours and shapes first.
WORDS: tuple[str, ...] = (
    "red",
    "green",
    "blue",
    "yellow",
    "square",
    "circle",
    "a",
    "an",
    "the",
    "of",
    "and",
    "with",
    "on",
    "in",
    "photo",
    "picture",
    "image",
    "drawing",
    "small",
    "large",
    "big",
    "white",
    "black",
    "orange",
    "purple",
    "pink",
    "gray",
    "triangle",
    "star",
    "background",
    "shape",
    "colored",
    "bright",
    "dark",
    "blurry",
    "ugly",
    "low",
    "quality",
    "cat",
    "dog",
    "person",
    "style",
    "sks",
)

CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte → printable-character map (the byte-level alphabet of CLIP's BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def learn_bpe_merges(words: tuple[str, ...], end: str = "</w>") -> list[tuple[str, str]]:
    """Plain BPE training until every word is one symbol (its last character marked by `end`: none for byte-level
    BPE); ties broken by the pair's text so the result is deterministic. Standard BPE guarantees that applying these
    merges by rank re-creates each word whole."""
    seqs = [list(w[:-1]) + [w[-1] + end] for w in words]
    merges: list[tuple[str, str]] = []
    while True:
        pairs = Counter(p for s in seqs for p in zip(s, s[1:]))
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        seqs = [_merge(s, best) for s in seqs]


def _merge(seq: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def write_clip_vocab(folder: Path) -> None:
    """vocab.json + merges.txt in CLIP's layout: bytes, bytes+</w>, merged symbols, then the two specials."""
    alphabet = list(bytes_to_unicode().values())
    vocab_list = alphabet + [c + "</w>" for c in alphabet]
    merges = learn_bpe_merges(WORDS)
    vocab_list += ["".join(m) for m in merges if "".join(m) not in vocab_list]
    vocab_list += [CLIP_BOS, CLIP_EOS]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab_list)}, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


def build_clip_tokenizer(folder: Path, model_max_length: int):
    """A CLIPTokenizer loaded through from_pretrained from the files written here (the path real folders take)."""
    from transformers import CLIPTokenizer

    write_clip_vocab(folder)
    tok = CLIPTokenizer.from_pretrained(str(folder), model_max_length=model_max_length)
    return tok


def build_t5_tokenizer(folder: Path, model_max_length: int):
    """A Unigram tokenizer with T5's conventions (<pad>=0, </s>=1, <unk>=2, '▁' word marker), wrapped as
    T5TokenizerFast. Whole words score higher than their characters so Unigram prefers them."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -5.0) for c in string.printable.strip()]
    pieces += [("▁" + w, -1.0) for w in WORDS]
    tk = Tokenizer(Unigram(pieces, unk_id=2, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tk.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    return T5TokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=model_max_length,
    )
