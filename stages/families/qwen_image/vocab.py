"""The tiny flavor's Qwen2 tokenizer, built locally: byte-level BPE (any text tokenizes) with whole-word tokens for
the prompt template's words and the tiny vocabulary, and the chat specials. The pipeline drops the template's first
34 tokens (QwenImagePipeline.prompt_template_encode_start_idx, counted with Qwen's own tokenizer): this tokenizer
splits the template into exactly as many, which build_qwen_tokenizer asserts, so the dropped part is the template."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from tuneline.stages.families.vocab import WORDS, _merge, bytes_to_unicode

TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP = 34
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE training until every word is one symbol (ties broken by text: deterministic)."""
    seqs, merges = [list(w) for w in words if len(w) > 1], []
    while True:
        pairs = Counter(p for s in seqs for p in zip(s, s[1:]))
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        seqs = [_merge(s, best) for s in seqs]


def build_qwen_tokenizer(folder: Path, model_max_length: int):
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import Qwen2TokenizerFast

    byte = bytes_to_unicode()
    enc = {c: "".join(byte[b] for b in c.encode()) for c in set("".join(WORDS) + TEMPLATE)}
    plain = sorted(set(re.findall(r"[A-Za-z]+", TEMPLATE.replace("{}", ""))) | set(WORDS))
    words = [w for p in plain for w in (p, " " + p)]
    words = ["".join(enc.get(ch, ch) for ch in w) for w in words]
    merges = _merges(words)
    vocab_list = list(byte.values()) + ["".join(m) for m in merges]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(vocab_list))}
    tk = Tokenizer(BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    tok = Qwen2TokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
    )
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    prefix = TEMPLATE.split("{}")[0]
    assert len(tok(prefix).input_ids) == DROP, "the template prefix must be the 34 tokens the pipeline drops"
    tok.save_pretrained(str(folder))
    return tok
