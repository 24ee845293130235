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

# Qwen-VL's image tokens, in this order after the embedded vocabulary.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
# The embedded template, each message's content a string or a list of parts (text,
# and images written as the placeholder the processor expands), as Qwen-VL's does.
VISION_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '" + IMAGE_PART + "' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """How to write one vision-language family's checkpoint at a size class."""

    config_class: str  # transformers' classes, by name
    model_class: str
    vision: dict  # the tower's config
    image_processor: dict  # Qwen2VLImageProcessor's settings
    # mrope_section for a head of 64 (32 pairs), and the text config's own fields.
    mrope_section: tuple[int, int, int]
    text: dict


# Qwen2.5-VL's tower: two blocks (a window one, a full one), 2x2 merging, a 56-pixel
# window (2x2 merged patches). Qwen3-VL's: three blocks, the first two giving DeepStack
# features, 16-pixel patches and learned positions. Images of up to 448x448 pixels
# (256 embeddings) keep the CPU tests quick.
FAMILIES = {
    "qwen2_5_vl": Family(
        "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
        dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2, window_size=56,
             fullatt_block_indexes=[1]),
        dict(min_pixels=56 * 56, max_pixels=448 * 448),
        (8, 12, 12), {},
    ),
    "qwen3_vl": Family(
        "Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
        dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
             spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
             deepstack_visual_indexes=[0, 1]),
        dict(min_pixels=64 * 64, max_pixels=448 * 448, patch_size=16,
             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]),
        (12, 10, 10), {"attention_bias": False},
    ),
}  # fmt: skip


def write_vision_model(out: Path, size: str = "tiny", seed: int = 0,
                       vision: dict | None = None, arch: str = "qwen2_5_vl") -> Path:  # fmt: skip
    """vision: the tower's config fields over the family's (a bench's larger tower)."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    family = FAMILIES[arch]
    out.mkdir(parents=True, exist_ok=True)
    vocab = embedded_vocabulary()
    tokenizer = vocab.tokenizer
    tokenizer.add_special_tokens(list(VISION_TOKENS))
    ids = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS}
    dims = SIZES[size]
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    scale = head_dim // 64  # the sections are for a head of 64
    config = getattr(transformers, family.config_class)(
        text_config=dict(vocab_size=tokenizer.get_vocab_size(), **dims, head_dim=head_dim,
                         max_position_embeddings=2048, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [scale * n for n in
                                                            family.mrope_section]},
                         **family.text, **vocab.ids()),
        vision_config={**family.vision, **(vision or {}), "out_hidden_size": dims["hidden_size"]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "patch_embed" not in name:
                p.mul_(WEIGHT_SCALE)
    model.save_pretrained(out)
    Qwen2VLImageProcessor(**family.image_processor).save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "generation_config.json", vocab.ids())
    write_json(out / "special_tokens_map.json", vocab.special)
    (out / "chat_template.jinja").write_text(VISION_TEMPLATE + "\n")
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
        "clean_up_tokenization_spaces": False, **vocab.special,
    })  # fmt: skip
    for path in out.iterdir():
        path.chmod(0o644)
    return out
