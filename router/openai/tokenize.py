"""vLLM's tokenizer routes, which eval harnesses probe (lm-eval's remote tokenizer
backend): /tokenize (a prompt, or chat messages through the chat template),
/detokenize and /tokenizer_info; and its render routes, which llm-d's endpoint picker
calls for the token ids it hashes to score each pod's cached blocks (docs/llm-d.md):
/v1/completions/render and /v1/chat/completions/render. They answer from the router's
own tokenizer, template and image processor."""

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import Field

from flagstop.router.chat import ChatTemplate
from flagstop.router.media.processor import Processed
from flagstop.router.openai.chat_path import ChatPath
from flagstop.router.openai.chat_request import (
    ChatCompletionRequest,
    ChatMessage,
    TemplateParams,
    ToolDefinition,
)
from flagstop.router.openai.errors import OpenAIError, json_response
from flagstop.router.openai.front import Front, authorized
from flagstop.router.openai.protocol import CompletionRequest, EncodableText, TokenId
from flagstop.router.validation import prompt_ids
from flagstop.scheduler_svc.core.limits import RequestRejected


class TokenizeRequest(TemplateParams, EncodableText):
    """A prompt, or messages (then the chat template renders them first, with the
    chat fields that shape a prompt: chat_template_kwargs and the like)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the prompt's BOS; templates write their own
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools or []] or None


class DetokenizeRequest(EncodableText):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


def tokenize(request: TokenizeRequest, tokenizer, path: ChatPath) -> list[int]:
    """The token ids the engine would see. Raises ValueError for neither or both."""
    if (request.prompt is None) == (request.messages is None):
        raise ValueError("set exactly one of prompt and messages")
    if request.messages is not None:
        return path.render(request).token_ids
    return tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids


def tokenize_response(token_ids: list[int], tokenizer, max_model_len: int, strs: bool):
    body: dict[str, Any] = {"count": len(token_ids), "max_model_len": max_model_len,
                            "tokens": token_ids, "token_strs": None}  # fmt: skip
    if strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(token_ids)
    return body


def tokenizer_info(tokenizer, chat: ChatTemplate) -> dict[str, Any]:
    """The tokenizer's class and configuration, as vLLM's /tokenizer_info gives it."""
    special = {name: getattr(tokenizer, name, None) for name in
               ("bos_token", "eos_token", "pad_token", "unk_token")}  # fmt: skip
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "model_max_length": min(getattr(tokenizer, "model_max_length", 0) or 0, 2**31 - 1),
        **{k: v for k, v in special.items() if isinstance(v, str)},
        "chat_template": chat.template,
    }


api = APIRouter(dependencies=[Depends(authorized)])


@api.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, front: Front) -> Response:
    if body.model is not None:
        front.check_model(body.model)
    engine = front.engine
    try:
        token_ids = tokenize(body, engine.tokenizer, front.chat_path)
    except ValueError as e:
        raise OpenAIError(400, str(e)) from None
    max_model_len = engine.model_info.max_model_len
    return json_response(tokenize_response(token_ids, engine.tokenizer, max_model_len,
                                           body.return_token_strs))  # fmt: skip


@api.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, front: Front) -> Response:
    if body.model is not None:
        front.check_model(body.model)
    tokenizer = front.engine.tokenizer
    if bad := [t for t in body.tokens if t >= len(tokenizer)]:
        raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
    return json_response({"prompt": tokenizer.decode(body.tokens)})


@api.get("/tokenizer_info")
async def tokenizer_info_route(front: Front) -> Response:
    return json_response(tokenizer_info(front.engine.tokenizer, front.chat))


def render_features(media: Processed | None) -> dict[str, Any] | None:
    """vLLM's render features: each image's content hash (the one the KV events' extra
    keys carry, so the picker's keys and the pod's agree) and its placeholder's span."""
    if media is None:
        return None
    return {
        "mm_hashes": {"image": [m.hash.hex() for m in media.media]},
        "mm_placeholders": {"image": [{"offset": m.offset, "length": m.length}
                                      for m in media.media]},
    }  # fmt: skip


@api.post("/v1/completions/render")
async def completions_render_route(body: CompletionRequest, front: Front) -> Response:
    """Each prompt's token ids, as /v1/completions would send them to the engine."""
    model = front.check_model(body.model)
    tokenizer = front.engine.tokenizer
    try:
        rendered = [prompt_ids(body.choice_request(prompt, 0), tokenizer)
                    for prompt in body.prompts()]  # fmt: skip
    except RequestRejected as e:
        raise OpenAIError(400, str(e), e.param) from None
    return json_response([{"model": model, "token_ids": token_ids, "features": None}
                          for token_ids in rendered])  # fmt: skip


@api.post("/v1/chat/completions/render")
async def chat_render_route(body: ChatCompletionRequest, front: Front) -> Response:
    """The prompt's token ids as /v1/chat/completions renders them, images expanded."""
    model = front.check_model(body.model)
    prompt = await front.render(body)
    return json_response({"model": model, "token_ids": prompt.token_ids,
                          "features": render_features(prompt.media)})  # fmt: skip
