"""A vision-language checkpoint of the embedded model's size class, made with
transformers' own classes: the model (seeded random weights, the 2-D ones drawn
WEIGHT_SCALE times wider as make_model's are), its image processor's
preprocessor_config.json, the embedded tokenizer with the family's image tokens and a
chat template that writes each image part as the family's placeholder. Written by
`python -m tools.make_model --arch qwen2_5_vl` (docs/multimodal.md)."""

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
# The tower: two blocks (a window one, a full one), 2x2 merging, a 56-pixel window
# (2x2 merged patches); images of up to 448x448 pixels (256 embeddings) keep the CPU
# tests quick.
VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=56,
              fullatt_block_indexes=[1])  # fmt: skip
MIN_PIXELS, MAX_PIXELS = 56 * 56, 448 * 448


def write_vision_model(out: Path, size: str = "tiny", seed: int = 0,
                       vision: dict | None = None) -> Path:  # fmt: skip
    """vision: the tower's config fields over VISION's (a bench's larger tower)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    out.mkdir(parents=True, exist_ok=True)
    vocab = embedded_vocabulary()
    tokenizer = vocab.tokenizer
    tokenizer.add_special_tokens(list(VISION_TOKENS))
    ids = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS}
    dims = SIZES[size]
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    quarter = head_dim // 16  # mrope_section: pairs for (t, h, w), as Qwen's 16/24/24
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=tokenizer.get_vocab_size(), **dims, head_dim=head_dim,
                         max_position_embeddings=2048, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2 * quarter, 3 * quarter,
                                                            3 * quarter]},
                         **vocab.ids()),
        vision_config={**VISION, **(vision or {}), "out_hidden_size": dims["hidden_size"]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "patch_embed" not in name:
                p.mul_(WEIGHT_SCALE)
    model.save_pretrained(out)
    Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out)
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
