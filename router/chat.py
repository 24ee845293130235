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
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt=True
    ) -> list[int]:
        """The prompt's token ids, the assistant's turn opened. Raises RequestRejected
        for a model without a template, or messages its template refuses."""
        if not self.template:
            raise RequestRejected(
                "this model has no chat template: use /v1/completions, or start the router "
                "with --chat-template FILE",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )  # fmt: skip
        except (TemplateError, TypeError, ValueError, KeyError) as e:  # a template's own
            # raise_exception() is a TemplateError; its filters raise the others
            message = f"the chat template refused the messages: {e}"
            raise RequestRejected(message, "messages") from None
        # Templates write their own BOS and other special tokens.
        return self.tokenizer(text, add_special_tokens=False).input_ids
