"""`caption.model: tiny`: random-weight vision-language models built from transformers configs, in the two
processor styles real captioners use: Qwen2-VL (a chat template whose image placeholder the processor expands to
one token per merged patch, M-RoPE positions) and LLaVA (a CLIP vision tower, `<image>` expanded to its patches).

The folder is written with save_pretrained and then loaded like any user's folder (stages/caption/model.py), so
the real loading and generation paths run. The tokenizer is built locally (no hub): whole words from the demo's
vocabulary, so generated captions are readable random words, deterministic for a given image and prompt.
"""

from __future__ import annotations

from pathlib import Path

STYLES = {"tiny": "qwen2_vl", "tiny:qwen2_vl": "qwen2_vl", "tiny:llava": "llava"}
BUILD_SEED = 1234
QWEN_SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|endoftext|>",
]
LLAVA_SPECIALS = ["<s>", "</s>", "<pad>", "<image>"]
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def is_tiny(model: str) -> bool:
    return model in STYLES


def tiny_dir(model: str, cache_dir: Path) -> Path:
    """Where the tiny model of that style is built (once per workdir)."""
    return cache_dir / f"caption-tiny-{STYLES[model]}"


def _tokenizer(specials: list[str], **roles):
    """A word-level tokenizer: the demo vocabulary, punctuation and single letters; anything else is <unk>."""
    import string

    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from tuneline.stages.families.vocab import WORDS

    words = ["<unk>", *WORDS, *string.ascii_lowercase, *".,:;!?'\"-()"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tk = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", additional_special_tokens=specials, **roles)


def build(model: str, folder: Path, text: dict | None = None) -> Path:
    """Write the tiny model of `model`'s style to `folder` (atomically: a killed build leaves no half folder).
    `text` overrides the language model's config (bench/caption.py builds one of realistic decode cost)."""
    import os
    import shutil

    import torch

    style = STYLES[model]
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = torch.random.get_rng_state()
    torch.manual_seed(BUILD_SEED)
    try:
        net, proc = _qwen2_vl(text or {}) if style == "qwen2_vl" else _llava(text or {})  # proc(folder) saves it
    finally:
        torch.random.set_rng_state(state)
    net.save_pretrained(tmp)
    proc(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process built it first: same seed, same weights
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# The language model of both tiny captioners: 2 layers, 64 wide, grouped-query attention as the released ones have.
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _qwen2_vl(overrides: dict):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tok = _tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = tok.convert_tokens_to_ids
    text = (
        dict(
            vocab_size=len(tok),
            **DECODER,
            max_position_embeddings=4096,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            eos_token_id=ids("<|im_end|>"),
            bos_token_id=None,
            pad_token_id=ids("<|endoftext|>"),
        )
        | overrides
    )
    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=64,
        num_heads=2,
        mlp_ratio=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    vision["hidden_size"] = text["hidden_size"]  # the merger projects vision features to the text width
    half = text["hidden_size"] // text["num_attention_heads"] // 2  # M-RoPE splits half a head: time, height, width
    text["rope_scaling"] = {
        "type": "mrope",
        "mrope_section": [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2],
    }
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    images = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return Qwen2VLForConditionalGeneration(cfg).eval(), lambda folder: _save_parts(folder, tok, images)


def _save_parts(folder: Path, tok, images) -> None:
    """The processor's parts as a Qwen2-VL download has them. Qwen2VLProcessor itself cannot be built without
    torchvision (it insists on a video processor); the loader assembles an image-only one from these files."""
    import json

    tok.save_pretrained(folder)
    images.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN_TEMPLATE, encoding="utf-8")
    pre = folder / "preprocessor_config.json"
    pre.write_text(json.dumps(json.loads(pre.read_text()) | {"processor_class": "Qwen2VLProcessor"}, indent=2))


def _llava(overrides: dict):
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tok = _tokenizer(LLAVA_SPECIALS, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    ids = tok.convert_tokens_to_ids
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
    )
    text = (
        dict(
            model_type="llama",
            vocab_size=len(tok),
            **DECODER,
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
            bos_token_id=ids("<s>"),
        )
        | overrides
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    images = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    proc = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        chat_template=LLAVA_TEMPLATE,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return LlavaForConditionalGeneration(cfg).eval(), proc.save_pretrained
