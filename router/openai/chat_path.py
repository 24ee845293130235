"""What every chat-shaped API shares (chat completions, Responses, Anthropic's
Messages): the prompt rendered from the messages, each choice's GenerateRequest, and
the reader of each choice's output. One path for models whose chat template renders
the prompt and whose text the parsers read (ChatPath); gpt-oss's harmony format is
the other (router/openai/harmony.py: HarmonyPath), chosen by --reasoning-parser."""

from collections.abc import Callable

from flagstop.router.chat import ChatTemplate
from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.errors import OpenAIError
from flagstop.router.openai.outputs import ChatOutput, ReasoningSetup, Rendered, text_outputs
from flagstop.router.openai.reasoning import HARMONY
from flagstop.router.openai.tools import parser_factory
from flagstop.router.settings import RouterSettings
from flagstop.v1 import generation_pb2


class ChatPath:
    def __init__(self, chat: ChatTemplate, settings: RouterSettings, tokenizer) -> None:
        self.chat, self.settings = chat, settings
        self.reasoning = ReasoningSetup(settings.reasoning_parser, tokenizer)

    def render(self, body: ChatCompletionRequest) -> Rendered:
        """The prompt, by the model's chat template. Raises OpenAIError (400)."""
        try:
            options = body.template_options(self.settings.default_chat_template_kwargs)
        except ValueError as e:
            raise OpenAIError(400, str(e), "chat_template_kwargs") from None
        messages = [m.as_template_input() for m in body.messages]
        text = self.chat.render_text(messages, body.template_tools(), **options)
        return Rendered(text, self.chat.encode(text))

    def requests(
        self, body: ChatCompletionRequest, prompt: Rendered
    ) -> list[generation_pb2.GenerateRequest]:
        """A request per choice; an output constraint waits for the reasoning's end."""
        waits = self.reasoning.constraint_waits(
            prompt, self.settings.structured_outputs_in_reasoning
        )
        requests = [body.choice_request(prompt.token_ids, j) for j in range(body.n)]
        for request in requests:
            if waits and request.HasField("structured_outputs"):
                request.structured_outputs.after_token_ids.extend(waits)
        return requests

    def outputs(self, body: ChatCompletionRequest, prompt: Rendered) -> Callable[[], ChatOutput]:
        """What makes each choice's output reader. Raises RequestRejected ("auto"
        without a tool-call parser)."""
        tools = parser_factory(body, self.settings.tool_call_parser)
        return text_outputs(self.reasoning.parser(prompt), tools, body.include_reasoning)


def chat_path(chat: ChatTemplate, settings: RouterSettings, tokenizer) -> ChatPath:
    if settings.reasoning_parser == HARMONY:
        from flagstop.router.openai.harmony import HarmonyPath

        return HarmonyPath(chat, settings, tokenizer)
    return ChatPath(chat, settings, tokenizer)
