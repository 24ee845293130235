"""The models surface: /v1/models (the base model and each LoRA adapter, its parent the
base: vLLM's cards) and vLLM's runtime adapter routes, /v1/load_lora_adapter and
/v1/unload_lora_adapter (on every replica; 200 with vLLM's message, or the error)."""

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import ConfigDict, Field

from flagstop.router.openai.errors import from_failure, json_response
from flagstop.router.openai.front import Front, OpenAIFront, authorized
from flagstop.router.openai.protocol import EncodableText
from flagstop.router.pending import RequestFailed
from flagstop.scheduler_svc.convert import kv_layers_from_proto
from flagstop.scheduler_svc.core.kv_groups import describe_groups, kv_cache_groups

api = APIRouter(dependencies=[Depends(authorized)])


class LoadLoRAAdapterRequest(EncodableText):
    """vLLM's POST /v1/load_lora_adapter body: the name requests will give as their
    model, and the PEFT directory as each replica's executor reads it."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    # vLLM's: replace the adapter loaded under lora_name (its requests end); without
    # it a name loaded already is refused (400).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(EncodableText):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's, accepted and unused: adapters go by name


def model_cards(front: OpenAIFront) -> dict[str, dict]:
    info = front.engine.model_info
    front.check_model(info.model_name)
    base = {"id": info.model_name, "object": "model", "created": 0, "owned_by": "flagstop",
            "root": info.model_name, "parent": None,
            "max_model_len": info.max_model_len, **kv_cache_card(info),
            **encoder_card(front.engine),
            "retention": {"share": round(info.retention_share, 4),
                          "max_ttl_s": min(info.max_retention_s,
                                           front.engine.settings.max_cache_ttl_s)}}  # fmt: skip
    cards = {info.model_name: base}
    for name, adapter in sorted(front.engine.replicas.adapters().items()):
        cards[name] = {**base, "id": name, "root": adapter.path, "parent": info.model_name}
    return cards


def kv_cache_card(info) -> dict:
    """The KV cache as the model's layers make it (docs/kv_groups.md): its groups, the
    bytes a token takes over every layer on one rank, and the longest sequence it holds."""
    groups = kv_cache_groups(kv_layers_from_proto(info))
    return {"kv_cache_groups": describe_groups(groups),
            "kv_bytes_per_token": sum(x.kv_bytes_per_token for x in info.kv_layers),
            "kv_capacity_tokens": info.kv_capacity_tokens}  # fmt: skip


def encoder_card(engine) -> dict:
    """A vision-language model's images (docs/multimodal.md): the input modalities,
    the images a prompt may carry, and the scheduler's encoder budget and cache, in
    embedding tokens (their live use is in the metrics)."""
    info = engine.model_info
    if not info.accepts_images:
        return {"input_modalities": ["text"]}
    return {"input_modalities": ["text", "image"],
            "limit_mm_per_prompt": engine.settings.limit_mm_per_prompt,
            "max_num_encoder_input_tokens": info.max_num_encoder_input_tokens,
            "encoder_cache_size": info.encoder_cache_size}  # fmt: skip


@api.get("/v1/models")
async def models(front: Front) -> Response:
    return json_response({"object": "list", "data": list(model_cards(front).values())})


@api.get("/v1/models/{model_id:path}")
async def model(model_id: str, front: Front) -> Response:
    cards = model_cards(front)
    front.check_model(model_id)
    return json_response(cards[model_id])


@api.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, front: Front) -> Response:
    try:
        await front.engine.load_lora(body.lora_name, body.lora_path, body.load_inplace)
    except RequestFailed as e:
        raise from_failure(e) from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                    media_type="text/plain")  # fmt: skip


@api.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, front: Front) -> Response:
    try:
        await front.engine.unload_lora(body.lora_name)
    except RequestFailed as e:
        raise from_failure(e) from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                    media_type="text/plain")  # fmt: skip
