"""The tiny flavor's Qwen2 tokenizer, built locally: byte-level BPE (any text tokenizes) with whole-word tokens for
the prompt template's words and the tiny vocabulary, and the chat specials. The pipeline drops the template's first
34 tokens (QwenImagePipeline.prompt_template_encode_start_idx, counted with Qwen's own tokenizer): this tokenizer
splits the template into exactly as many, which build_qwen_tokenizer asserts, so the dropped part is the template."""

from __future__ import annotations

import re
from pathlib import Path

from tuneline.stages.families.vocab import WORDS, bytes_to_unicode, learn_bpe_merges

TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP = 34
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_bpe_tokenizer(folder: Path, words: list[str], model_max_length: int, specials: list[str]):
    """A Qwen2 byte-level BPE tokenizer whose merges make each of `words` one token, Qwen's chat specials and
    `specials` added; its tokenizer.json written to `folder` (the caller saves the rest once it checks it)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import Qwen2TokenizerFast

    byte = bytes_to_unicode()
    merges = learn_bpe_merges(tuple("".join(byte[b] for b in w.encode()) for w in words), end="")
    vocab = {t: i for i, t in enumerate(dict.fromkeys(list(byte.values()) + ["".join(m) for m in merges]))}
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
        pad_token=SPECIALS[0],
        model_max_length=model_max_length,
    )
    tok.add_special_tokens({"additional_special_tokens": [*SPECIALS[1:], *specials]})
    return tok


def build_qwen_tokenizer(folder: Path, model_max_length: int):
    plain = sorted(set(re.findall(r"[A-Za-z]+", TEMPLATE.replace("{}", ""))) | set(WORDS))
    tok = byte_bpe_tokenizer(folder, [w for p in plain for w in (p, " " + p)], model_max_length, [])
    prefix = TEMPLATE.split("{}")[0]
    assert len(tok(prefix).input_ids) == DROP, "the template prefix must be the 34 tokens the pipeline drops"
    tok.save_pretrained(str(folder))
    return tok
