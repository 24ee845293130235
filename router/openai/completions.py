"""The completions surface: /v1/completions and /v1/chat/completions, whole or as
Server-Sent Events (router/openai/front.py), n choices each."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from flagstop.router.openai.bodies import Choice
from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.front import Front, authorized
from flagstop.router.openai.protocol import CompletionRequest

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
    path = front.chat_path
    prompt = await front.render(body)
    outputs = path.outputs(body, prompt)
    return await front.respond(
        http,
        body,
        "chat",
        path.requests(body, prompt),
        lambda i, pending: Choice(i, output=outputs()),
        prompt.media,
    )
