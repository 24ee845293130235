"""The completions surface: /v1/completions and /v1/chat/completions, whole or as
Server-Sent Events (router/openai/front.py), n choices each."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from flagstop.router.openai.bodies import Choice
from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.front import Front, authorized
from flagstop.router.openai.protocol import CompletionRequest
from flagstop.router.openai.tools import parser_factory

api = APIRouter(dependencies=[Depends(authorized)])


@api.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request, front: Front) -> Response:
    prompts = body.prompts()
    requests = [body.choice_request(prompt, j) for prompt in prompts
                for j in range(body.n)]  # fmt: skip
    tokenizer = front.engine.tokenizer

    def make(i: int, pending) -> Choice:
        echo = None
        if body.echo:
            prompt = prompts[i // body.n]
            echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        return Choice(i, echo=echo, prompt_only=body.prompt_only)

    return await front.respond(http, body, "completion", requests, make)


@api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: Request, front: Front) -> Response:
    front.check_model(body.model)
    prompt = front.chat.render([m.as_template_input() for m in body.messages],
                               body.template_tools())  # fmt: skip
    requests = [body.choice_request(prompt, j) for j in range(body.n)]
    parser = parser_factory(body, front.settings.tool_call_parser)
    return await front.respond(http, body, "chat", requests,
                               lambda i, pending: Choice(i, tools=parser()))  # fmt: skip
