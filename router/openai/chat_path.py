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
        """A request per choice; an output constraint waits for the reasoning's end, and
        a thinking-token budget forces that end. Raises OpenAIError (400)."""
        in_reasoning = self.settings.structured_outputs_in_reasoning
        waits = self.reasoning.constraint_waits(prompt, in_reasoning)
        budget = self._budget(body, prompt)
        requests = [body.choice_request(prompt.token_ids, j) for j in range(body.n)]
        if body.retention is not None:
            retention = self._retention(body)
            for request in requests:
                request.retention.CopyFrom(retention)
        for request in requests:
            constrained = request.HasField("structured_outputs")
            if waits and (constrained or budget):
                request.structured_outputs.after_token_ids.extend(waits)
            if waits and budget:
                request.structured_outputs.force_after_within = budget
                request.structured_outputs.open_token_ids.extend(self.reasoning.opening(prompt))
        return requests

    def _retention(self, body: ChatCompletionRequest) -> generation_pb2.Retention:
        """The retention hint with its breakpoint in tokens: the prompt rendered
        through that message (no generation prompt), as long as it is (0: all)."""
        hint = body.retention
        assert hint is not None
        num_tokens = 0
        if hint.through_message is not None and hint.through_message + 1 < len(body.messages):
            messages = [m.as_template_input() for m in body.messages[: hint.through_message + 1]]
            options = body.template_options(self.settings.default_chat_template_kwargs)
            options |= {"add_generation_prompt": False, "continue_final_message": False}
            text = self.chat.render_text(messages, body.template_tools(), **options)
            num_tokens = len(self.chat.encode(text))
        return generation_pb2.Retention(priority=hint.priority, ttl_s=hint.ttl_s,
                                        num_tokens=num_tokens)  # fmt: skip

    def _budget(self, body: ChatCompletionRequest, prompt: Rendered) -> int:
        """thinking_token_budget, where there is a reasoning to end (0: none). Without
        a reasoning parser the output is all answer, as far as this router can tell:
        the budget is met (Anthropic's clients send one with every thinking request)."""
        budget = body.thinking_token_budget
        if budget is None or self.reasoning.format is None:
            return 0
        if self.settings.structured_outputs_in_reasoning:
            raise OpenAIError(400, "thinking_token_budget ends the reasoning, which "
                              "--structured-outputs-in-reasoning constrains from its start: "
                              "drop one of them", "thinking_token_budget")  # fmt: skip
        return max(budget, 1)

    def outputs(self, body: ChatCompletionRequest, prompt: Rendered) -> Callable[[], ChatOutput]:
        """What makes each choice's output reader. Raises RequestRejected ("auto"
        without a tool-call parser)."""
        tools = parser_factory(body, self.settings.tool_call_parser)
        return text_outputs(self.reasoning.parser(prompt), tools, body.include_reasoning)
