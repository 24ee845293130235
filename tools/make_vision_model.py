"""A vision-language checkpoint of the embedded model's size class, made with
transformers' own classes: the model (seeded random weights, the 2-D ones drawn
WEIGHT_SCALE times wider as make_model's are), its image processor's
preprocessor_config.json, the embedded tokenizer with the family's image tokens and a
chat template that writes each image part as the family's placeholder. Written by
`python -m tools.make_model --arch qwen2_5_vl` (docs/multimodal.md)."""

from dataclasses import dataclass
from pathlib import Path

import torch

from tools.make_model import SIZES, WEIGHT_SCALE, embedded_vocabulary, write_json

# Qwen-VL's image tokens, in this order after the embedded vocabulary, and the
# placeholder an image part is written as; Gemma 3's.
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
GEMMA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA_IMAGE_PART = "<start_of_image>"


def template(image_part: str) -> str:
    """The embedded template, each message's content a string or a list of parts (text,
    and images written as the placeholder the processor expands), as Qwen-VL's and
    Gemma 3's do."""
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ('image', 'image_url') %}{{ '" + image_part + "' }}"
        "{% endif %}{% endfor %}{% endif %}"
        "{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    )


@dataclass(frozen=True)
class Family:
    """How to write one vision-language family's checkpoint at a size class."""

    config_class: str  # transformers' classes, by name
    model_class: str
    image_processor_class: str
    vision: dict  # the tower's config
    image_processor: dict  # its settings
    tokens: tuple[str, ...]  # the image tokens the vocabulary gains
    image_part: str  # what an image part of a message is written as
    # The text config's own fields, and the top level's (token ids by name: each's
    # field -> the token).
    text: dict
    top: dict
    token_fields: dict
    # mrope_section for a head of 64 (32 pairs); () for plain RoPE.
    mrope_section: tuple[int, ...] = ()


# Qwen2.5-VL's tower: two blocks (a window one, a full one), 2x2 merging, a 56-pixel
# window (2x2 merged patches). Qwen3-VL's: three blocks, the first two giving DeepStack
# features, 16-pixel patches and learned positions. Gemma 3's: SigLIP of two layers on
# 112x112 images (8x8 patches), pooled to 16 tokens an image, and the embedded
# Gemma 3's text layers (3 of 4 with a 64-token window). Images of up to 448x448
# pixels keep the CPU tests quick.
QWEN_IDS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
FAMILIES = {
    "qwen2_5_vl": Family(
        "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2VLImageProcessor",
        dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2, window_size=56,
             fullatt_block_indexes=[1]),
        dict(min_pixels=56 * 56, max_pixels=448 * 448), QWEN_TOKENS, IMAGE_PART,
        {}, {"tie_word_embeddings": False}, QWEN_IDS, (8, 12, 12),
    ),
    "qwen3_vl": Family(
        "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen2VLImageProcessor",
        dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
             spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
             deepstack_visual_indexes=[0, 1]),
        dict(min_pixels=64 * 64, max_pixels=448 * 448, patch_size=16,
             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]), QWEN_TOKENS, IMAGE_PART,
        {"attention_bias": False}, {"tie_word_embeddings": False}, QWEN_IDS, (12, 10, 10),
    ),
    "gemma3_vl": Family(
        "Gemma3Config", "Gemma3ForConditionalGeneration", "Gemma3ImageProcessor",
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             image_size=112, patch_size=14),
        dict(size={"height": 112, "width": 112}), GEMMA_TOKENS, GEMMA_IMAGE_PART,
        {"sliding_window": 64, "query_pre_attn_scalar": 64,
         "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
        {"mm_tokens_per_image": 16, "tie_word_embeddings": False},
        {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
         "image_token_index": "<image_soft_token>"},
    ),
}  # fmt: skip


def write_vision_model(out: Path, size: str = "tiny", seed: int = 0,
                       vision: dict | None = None, arch: str = "qwen2_5_vl") -> Path:  # fmt: skip
    """vision: the tower's config fields over the family's (a bench's larger tower)."""
    import transformers

    family = FAMILIES[arch]
    out.mkdir(parents=True, exist_ok=True)
    vocab = embedded_vocabulary()
    tokenizer = vocab.tokenizer
    tokenizer.add_special_tokens(list(family.tokens))
    dims = SIZES[size]
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if family.mrope_section:  # the sections are for a head of 64
        rope["mrope_section"] = [head_dim // 64 * n for n in family.mrope_section]
    vision_config = {**family.vision, **(vision or {})}
    if "out_hidden_size" not in vision_config and arch != "gemma3_vl":
        vision_config["out_hidden_size"] = dims["hidden_size"]
    text = dict(
        vocab_size=tokenizer.get_vocab_size(),
        **dims,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        **vocab.ids(),
        **family.text,
    )
    text.setdefault("rope_parameters", rope if arch != "gemma3_vl" else {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})  # fmt: skip
    token_ids = {field: tokenizer.token_to_id(t) for field, t in family.token_fields.items()}
    config = getattr(transformers, family.config_class)(
        text_config=text, vision_config=vision_config, **family.top, **token_ids
    )
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not p.any():  # Gemma 3's projection starts at zero
                p.normal_(0.0, 0.02)
            if p.dim() >= 2 and "patch_embed" not in name and "patch_embedding" not in name:
                p.mul_(WEIGHT_SCALE)
            elif p.dim() == 1:  # norms and biases off their init (a misload shows)
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    getattr(transformers, family.image_processor_class)(**family.image_processor) \
        .save_pretrained(out)  # fmt: skip
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "generation_config.json", vocab.ids())
    write_json(out / "special_tokens_map.json", vocab.special)
    (out / "chat_template.jinja").write_text(template(family.image_part) + "\n")
    # Gemma 3's processor reads its image tokens off the tokenizer, by these names.
    extra = {"boi_token": GEMMA_TOKENS[0], "eoi_token": GEMMA_TOKENS[1],
             "image_token": GEMMA_TOKENS[2]} if arch == "gemma3_vl" else {}  # fmt: skip
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
        "clean_up_tokenization_spaces": False, **vocab.special,
        **({"extra_special_tokens": extra} if extra else {}),
    })  # fmt: skip
    for path in out.iterdir():
        path.chmod(0o644)
    return out
