"""Tool calls read out of what a model writes, one parser per family's format
(--tool-call-parser, vLLM's names), each in a file of its own with the formats it
reads; base.py holds the rule they share (a call is given out whole when it closes;
what does not read as a call is content, as written). docs/openai.md's parser table
says, per family, what is read and where flagstop differs from vLLM and SGLang.

    hermes       <tool_call>{"name": N, "arguments": {...}}</tool_call>
    qwen3_coder  <tool_call><function=N><parameter=P>V</parameter>...</function></tool_call>
    llama3_json  {"name": N, "parameters": {...}}; {...}   (<|python_tag|> or not)
    mistral      [TOOL_CALLS][{"name": N, "arguments": {...}}]  or  [TOOL_CALLS]N[ARGS]{...}
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}...
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.N:0
                 <|tool_call_argument_begin|>{...}<|tool_call_end|>...
    glm45        <tool_call>N<arg_key>P</arg_key><arg_value>V</arg_value>...</tool_call>"""

from flagstop.router.openai.tool_parsers.base import Call, CallParser, new_call_id
from flagstop.router.openai.tool_parsers.constrained import NamedCall, RequiredCalls
from flagstop.router.openai.tool_parsers.deepseek import DeepSeekV3
from flagstop.router.openai.tool_parsers.glm45 import Glm45
from flagstop.router.openai.tool_parsers.hermes import Hermes
from flagstop.router.openai.tool_parsers.kimi_k2 import KimiK2
from flagstop.router.openai.tool_parsers.llama3_json import Llama3Json
from flagstop.router.openai.tool_parsers.mistral import Mistral
from flagstop.router.openai.tool_parsers.qwen3_coder import Qwen3Coder

PARSERS: dict[str, type[CallParser]] = {
    "hermes": Hermes, "qwen3_coder": Qwen3Coder, "llama3_json": Llama3Json,
    "mistral": Mistral, "deepseek_v3": DeepSeekV3, "kimi_k2": KimiK2, "glm45": Glm45,
}  # fmt: skip

__all__ = ["PARSERS", "Call", "CallParser", "NamedCall", "RequiredCalls", "new_call_id"]
