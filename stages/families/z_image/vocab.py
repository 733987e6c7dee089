"""A tiny Qwen-style tokenizer (byte-level BPE, Qwen's special tokens and chat template), built locally.

Z-Image and FLUX.2 [klein] feed their captions to a Qwen3 language model through the tokenizer's chat template;
the tiny flavors need a tokenizer with the same conventions (pad = <|endoftext|>, <|im_start|>/<|im_end|> turns, a
template that takes `enable_thinking`) so the adapters run the same calls on tiny and real folders.
"""
from __future__ import annotations

import json
from pathlib import Path

from tuneline.stages.families.vocab import WORDS, bytes_to_unicode, learn_bpe_merges

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's template for what the pipelines send (one user turn, add_generation_prompt): `enable_thinking=False`
# appends an empty think block, as Qwen3's own template does.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_qwen_tokenizer(folder: Path, model_max_length: int):
    """A Qwen2TokenizerFast written to `folder` and loaded back through from_pretrained (the path real folders
    take). Words are learned with GPT-2's leading-space marker so " red" is one token."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    byte_map = bytes_to_unicode()
    space = byte_map[ord(" ")]
    alphabet = list(byte_map.values())
    merges = [m for m in learn_bpe_merges(tuple(space + w for w in WORDS))]
    # learn_bpe_merges marks word ends with </w>; byte-level BPE has no end marker: drop it from the merges.
    merges = [(a.replace("</w>", ""), b.replace("</w>", "")) for a, b in merges]
    vocab = {t: i for i, t in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab]
    tk = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, model_max_length=model_max_length, pad_token=SPECIALS[0],
                                  eos_token=SPECIALS[2], additional_special_tokens=list(SPECIALS[1:]))
    tok.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
