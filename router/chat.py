"""Chat prompts: a model's own chat template (tokenizer_config.json or
chat_template.jinja in its directory, as transformers loads it), or --chat-template
FILE, rendered by transformers' apply_chat_template."""

from pathlib import Path

from jinja2 import TemplateError

from flagstop.scheduler_svc.core.limits import RequestRejected


class ChatTemplate:
    def __init__(self, tokenizer, override: Path | None = None) -> None:
        self.tokenizer = tokenizer
        self.template: str | None = override.read_text() if override else tokenizer.chat_template

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt=True,
        **options,
    ) -> list[int]:  # fmt: skip
        """The prompt's token ids, the assistant's turn opened."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt, **options))

    def encode(self, text: str) -> list[int]:
        # Templates write their own BOS and other special tokens.
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def render_text(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt=True,
        continue_final_message=False, template: str | None = None, variables=None,
    ) -> str:  # fmt: skip
        """The prompt's text, the assistant's turn opened (or its last message left open
        to continue). template: a request's own; variables: chat_template_kwargs (a
        thinking switch, a reasoning effort). Raises RequestRejected for a model
        without a template, or messages its template refuses."""
        template = template or self.template
        if not template:
            raise RequestRejected(
                "this model has no chat template: use /v1/completions, or start the router "
                "with --chat-template FILE",
                param="messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(variables or {}),
            )  # fmt: skip
        except (TemplateError, TypeError, ValueError, KeyError) as e:  # a template's own
            # raise_exception() is a TemplateError; its filters raise the others
            message = f"the chat template refused the messages: {e}"
            raise RequestRejected(message, "messages") from None
