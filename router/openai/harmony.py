"""gpt-oss' harmony format, through openai-harmony (the format's own library): the
conversation rendered by it (a system message with the reasoning effort, a developer
message with the request's instructions and function tools, the history's messages,
calls and tool results), and the output read by its streaming parser, channel by
channel: analysis is the reasoning, final the content, a commentary message to
`functions.NAME` a tool call (given out whole when its message ends, as the text
parsers give theirs: router/openai/tool_parsers/base.py). The model stops at
harmony's <|return|> and <|call|>. Chosen by --reasoning-parser openai_gptoss (with
--tool-call-parser openai for tool_choice "auto"); the model's tokenizer must be
gpt-oss' (o200k_harmony), so that harmony's token ids are the model's."""

import logging
from dataclasses import dataclass, field
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    StreamableParser,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from flagstop.router.openai.chat_path import ChatPath
from flagstop.router.openai.chat_request import ChatCompletionRequest
from flagstop.router.openai.errors import OpenAIError
from flagstop.router.openai.harmony_vocab import BASE_VARIABLE, use_vocab
from flagstop.router.openai.outputs import Parsed, Rendered
from flagstop.router.openai.tool_parsers import Call, new_call_id
from flagstop.router.openai.tool_parsers.arguments import as_object_text
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.server import StartupError

log = logging.getLogger("flagstop.router.harmony")
EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
           "high": ReasoningEffort.HIGH}  # fmt: skip
FUNCTIONS = "functions."
# Where an output constraint starts: the final answer's message.
FINAL = "<|channel|>final<|message|>"


def load_encoding():
    """harmony's gpt-oss encoding. Raises StartupError when its vocabulary is not to
    be had (no network, no copy)."""
    use_vocab()
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as e:
        raise StartupError(
            f"--reasoning-parser openai_gptoss: openai-harmony cannot load its vocabulary "
            f"({e}); run `python -m tools.harmony_vocab` once, or set {BASE_VARIABLE} to a "
            "directory holding o200k_base.tiktoken"
        ) from None


class HarmonyPath(ChatPath):
    def __init__(self, chat, settings, tokenizer) -> None:
        super().__init__(chat, settings, tokenizer)
        self.encoding = load_encoding()
        start = self.encoding.encode("<|start|>", allowed_special="all")
        if tokenizer.convert_tokens_to_ids("<|start|>") != start[0]:
            raise StartupError(
                "--reasoning-parser openai_gptoss needs gpt-oss' tokenizer (o200k_harmony), "
                "whose ids harmony's are; this model's tokenizer is another"
            )
        self.stop_token_ids = list(self.encoding.stop_tokens_for_assistant_actions())
        self.final_token_ids = self.encoding.encode(FINAL, allowed_special="all")

    def render(self, body: ChatCompletionRequest) -> Rendered:
        conversation = Conversation.from_messages(self.messages(body))
        try:
            ids = self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
        except HarmonyError as e:
            raise OpenAIError(400, f"messages: harmony cannot render them: {e}") from None
        return Rendered("", list(ids))

    def messages(self, body: ChatCompletionRequest) -> list[Message]:
        """The conversation as harmony's messages."""
        effort = body.reasoning_effort or "medium"
        if effort not in EFFORTS:
            raise OpenAIError(400, f"reasoning_effort {effort!r}: gpt-oss takes low, medium "
                                   "or high", "reasoning_effort")  # fmt: skip
        system = SystemContent.new().with_reasoning_effort(EFFORTS[effort])
        out = [Message.from_role_and_content(Role.SYSTEM, system)]
        if developer := self._developer(body):
            out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
        names: dict[str, str] = {}  # call id -> function name, for the results
        for message in body.messages:
            out += _history(message, names)
        return out

    @staticmethod
    def _developer(body: ChatCompletionRequest) -> DeveloperContent | None:
        instructions = "\n\n".join(
            m.as_template_input()["content"] for m in body.messages
            if m.role in ("system", "developer")
        )  # fmt: skip
        tools = [ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                     parameters=t["function"].get("parameters"))
                 for t in body.template_tools() or ()]  # fmt: skip
        if not instructions and not tools:
            return None
        content = DeveloperContent.new()
        if instructions:
            content = content.with_instructions(instructions)
        return content.with_function_tools(tools) if tools else content

    def requests(self, body: ChatCompletionRequest, prompt: Rendered):
        if body.thinking_token_budget is not None:
            raise OpenAIError(400, "thinking_token_budget is not served with harmony: "
                              "gpt-oss' analysis cannot be cut into its final channel; send "
                              "reasoning_effort low", "thinking_token_budget")  # fmt: skip
        waits = [] if self.settings.structured_outputs_in_reasoning else self.final_token_ids
        requests = [body.choice_request(prompt.token_ids, j) for j in range(body.n)]
        for request in requests:
            request.stop_token_ids.extend(self.stop_token_ids)
            if waits and request.HasField("structured_outputs"):
                request.structured_outputs.after_token_ids.extend(waits)
        return requests

    def outputs(self, body: ChatCompletionRequest, prompt: Rendered):
        mode = body.tool_mode
        if mode in ("required", "named"):
            raise RequestRejected(
                f'tool_choice "{body.tool_choice if mode == "required" else "a named function"}" '
                'is not served with harmony: gpt-oss writes its calls itself; send "auto" '
                '(with --tool-call-parser openai) or "none"', "tool_choice")  # fmt: skip
        if mode == "auto" and self.settings.tool_call_parser != "openai":
            raise RequestRejected('tool_choice "auto" with gpt-oss needs the router started '
                                  "with --tool-call-parser openai", "tool_choice")  # fmt: skip
        encoding, show = self.encoding, body.include_reasoning
        return lambda: HarmonyOutput(encoding, show)


def _history(message, names: dict[str, str]) -> list[Message]:
    """One chat message as harmony's: system and developer ones went into the developer
    message; an assistant's reasoning, answer and calls; a tool's result, from the
    function its call named."""
    template = message.as_template_input()
    content = template["content"]
    if message.role == "user":
        return [Message.from_role_and_content(Role.USER, content)]
    if message.role == "tool":
        name = names.get(message.tool_call_id or "", "")
        author = Author.new(Role.TOOL, FUNCTIONS + name)
        return [Message.from_author_and_content(author, content).with_channel("commentary")
                .with_recipient("assistant")]  # fmt: skip
    if message.role != "assistant":
        return []
    out = []
    extra = message.model_extra or {}
    if reasoning := extra.get("reasoning") or extra.get("reasoning_content"):
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning)
                   .with_channel("analysis"))  # fmt: skip
    if content:
        out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
    for call in message.tool_calls or ():
        names[call.id] = call.function.name
        out.append(Message.from_role_and_content(Role.ASSISTANT, call.function.arguments)
                   .with_channel("commentary").with_recipient(FUNCTIONS + call.function.name)
                   .with_content_type("<|constrain|>json"))  # fmt: skip
    return out


@dataclass(slots=True)
class Pieces:
    """What a chunk's tokens add, as they are read."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class HarmonyOutput:
    """A choice's harmony output, read token by token by harmony's StreamableParser:
    analysis -> reasoning, final (and a preamble to nobody) -> content, a commentary
    message to functions.NAME -> a call, given out when its message ends (<|call|>)
    if its arguments are a JSON object; otherwise, or where max_tokens cut the
    message, its arguments are content, as written.
    Output that is not harmony (a model that does not write it) becomes content from
    where it broke.

    Only the parser's string getters are read per token (under a microsecond each);
    its `state` and `messages` serialize the whole parse to JSON (110 us a token at
    300 tokens: bench/output_bench.py), so a message's end is told by its end token."""

    __slots__ = ("began", "broken", "call", "calls", "encoding", "ends", "in_message",
                 "num_opened", "parser", "recipient", "show", "unread")  # fmt: skip

    def __init__(self, encoding, show_reasoning: bool) -> None:
        self.encoding, self.show = encoding, show_reasoning
        self.parser = StreamableParser(encoding, Role.ASSISTANT)
        self.ends = set(encoding.encode("<|end|><|call|><|return|>", allowed_special="all"))
        self.calls: list[dict[str, Any]] = []
        self.call: Call | None = None
        self.num_opened, self.broken, self.began, self.in_message = 0, False, False, False
        self.recipient = ""  # the open message's
        self.unread: list[int] = []  # tokens before the first message's content

    @property
    def in_reasoning(self) -> bool:
        return not self.broken and self.parser.current_channel == "analysis"

    def feed(self, token_ids, text: str, finish: str | None) -> Parsed:
        parsed = Pieces()
        tokens = list(token_ids)
        for i, token in enumerate(tokens):
            if self.broken:
                parsed.content += self.encoding.decode(tokens[i:])
                break
            self._one(token, parsed)
        if finish and self.unread and not self.broken and not self.began:
            parsed.content += self.encoding.decode(self.unread)  # never harmony: what it wrote
        if finish and self.call is not None:  # the output ended inside a call's message
            self._call_ended(parsed, cut=finish == "length")
        return Parsed(parsed.reasoning if self.show else "", parsed.content, parsed.calls)

    def _one(self, token: int, parsed: Pieces) -> None:
        parser = self.parser
        try:
            parser.process(token)
        except HarmonyError as e:
            log.debug("output that is not harmony: %s", e)
            self.broken = True
            if self.call is not None:  # a call it broke off: what it wrote is content
                parsed.content += self.call.arguments
                self.call = None
            parsed.content += self.encoding.decode([*self.unread, token] if not self.began
                                                   else [token])  # fmt: skip
            return
        channel = parser.current_channel
        if channel is None:  # a header, or a message's end
            if not self.began:
                self.unread.append(token)
            if token in self.ends and self.in_message:
                self._message_ended(parsed)
            return
        self.began, self.in_message = True, True
        self.recipient = parser.current_recipient or ""
        if delta := parser.last_content_delta:
            if self.recipient.startswith(FUNCTIONS):
                self._arguments(delta)
            elif channel == "analysis":
                parsed.reasoning += delta
            else:
                parsed.content += delta

    def _arguments(self, delta: str) -> None:
        if self.call is None:
            name = self.recipient.removeprefix(FUNCTIONS)
            self.call = Call(self.num_opened, name, new_call_id())
        self.call.arguments += delta

    def _message_ended(self, parsed: Pieces) -> None:
        self.in_message = False
        if self.call is None and self.recipient.startswith(FUNCTIONS):  # no arguments
            self._arguments("{}")
        if self.call is not None:
            self._call_ended(parsed, cut=False)

    def _call_ended(self, parsed: Pieces, cut: bool) -> None:
        call, self.call = self.call, None
        arguments = None if cut else as_object_text(call.arguments)
        if arguments is None:
            parsed.content += call.arguments
            return
        call.arguments, call.index = arguments, self.num_opened
        self.num_opened += 1
        self.calls.append(call.as_dict())
        parsed.calls.append({"index": call.index, **call.as_dict()})
