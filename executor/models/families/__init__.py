"""The supported architectures, a file per family (docs/models.md, "Adding a family").
Each declares how its models leave the Llama decoder (family.py); this registry is
the one list of them."""

from flagstop.executor.models.families import (
    deepseek,
    gemma,
    glm,
    gpt_oss,
    granite,
    llama,
    mixtral,
    qwen,
    qwen3_next,
    qwen_vl,
)
from flagstop.executor.models.families.family import Architecture, MoeLayout, VisionLayout

FAMILIES = (llama, qwen, mixtral, gemma, gpt_oss, deepseek, glm, qwen3_next, granite, qwen_vl)

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for family in FAMILIES for a in family.ARCHITECTURES
}

__all__ = ["ARCHITECTURES", "FAMILIES", "Architecture", "MoeLayout", "VisionLayout"]
