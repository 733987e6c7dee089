"""Qwen3 text encoding shared by the families that caption through a Qwen3 language model (Z-Image, FLUX.2 [klein]),
and a tiny Qwen-style tokenizer (byte-level BPE, Qwen's special tokens and chat template) built locally for their
tiny flavors, with the same conventions (pad = <|endoftext|>, <|im_start|>/<|im_end|> turns, a template that takes
`enable_thinking`) so the adapters run the same calls on tiny and real folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tuneline.stages.families.base import TextEncoders
from tuneline.stages.families.common import module_device
from tuneline.stages.families.vocab import WORDS, bytes_to_unicode, learn_bpe_merges

TINY_TEXT_WIDTH = 32  # the tiny Qwen3's hidden size

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's template for what the pipelines send (one user turn, add_generation_prompt): `enable_thinking=False`
# appends an empty think block, as Qwen3's own template does.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_qwen_tokenizer(folder: Path, model_max_length: int):
    """A Qwen-style tokenizer written to `folder` and loaded back through from_pretrained (the path real folders
    take)."""
    return build_bpe_tokenizer(folder, model_max_length, SPECIALS, CHAT_TEMPLATE, eos=SPECIALS[2])


def build_bpe_tokenizer(
    folder: Path,
    model_max_length: int,
    specials: tuple[str, ...],
    chat_template: str,
    eos: str | None = None,
    words: tuple[str, ...] = WORDS,
):
    """A byte-level BPE fast tokenizer (pad = specials[0]) with `chat_template`, written to `folder` and loaded back.
    `words` are learned with GPT-2's leading-space marker so " red" is one token."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    byte_map = bytes_to_unicode()
    space = byte_map[ord(" ")]
    alphabet = list(byte_map.values())
    merges = learn_bpe_merges(tuple(space + w for w in words))
    # learn_bpe_merges marks word ends with </w>; byte-level BPE has no end marker: drop it from the merges.
    merges = [(a.replace("</w>", ""), b.replace("</w>", "")) for a, b in merges]
    vocab = {t: i for i, t in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab]
    tk = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        model_max_length=model_max_length,
        pad_token=specials[0],
        eos_token=eos,
        additional_special_tokens=list(specials[1:]),
    )
    tok.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def chat_prompts(tokenizer: Any, captions: list[str], enable_thinking: bool = True) -> list[str]:
    """Captions wrapped in the tokenizer's chat template as one user turn, as ZImagePipeline._encode_prompt (and
    Flux2KleinPipeline, with thinking off) do."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        for c in captions
    ]


def qwen_hidden(enc: TextEncoders, prompts: list[str], layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states of `layers` side by side (B, L, D * len(layers)), attention mask (B, L)) at enc.max_length
    tokens, padded as the pipelines pad."""
    tok, te = enc.tokenizers[0], enc.encoders[0]
    ids = tok(prompts, padding="max_length", max_length=enc.max_length, truncation=True, return_tensors="pt")
    dev = module_device(te)
    mask = ids.attention_mask.to(dev)
    with torch.no_grad():
        out = te(input_ids=ids.input_ids.to(dev), attention_mask=mask, output_hidden_states=True, use_cache=False)
    hidden = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    return hidden, mask


def tiny_qwen3(tokenizer: Any, width: int = TINY_TEXT_WIDTH, layers: int = 2, causal_lm: bool = False):
    """A Qwen3 decoder (grouped-query attention, q/k norms) `width` wide; with its LM head for `causal_lm` (the
    class FLUX.2 [klein] names), the bare model otherwise (Z-Image's)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(cfg)
