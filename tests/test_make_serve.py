"""`make serve` as a new user runs it, and the README's quickstart run at once: the
client waits for the router to serve (within its timeout) instead of failing, and
while the stack starts the HTTP front's readiness and its routes agree (no route
answers before /ready does, none refuses after). Then the agent path's lost-call
cases through the same stack with the openai and anthropic SDKs, streamed and whole:
a call the model ended without its closing tag, a call max_tokens cut, the words
around a call, and (a thinking model, `make serve THINKING=1` with deepseek_r1) a
<think> the model writes although its template opened the reasoning. Outputs are
scripted with output constraints (as tests/test_agents.py does)."""

import base64
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest

from tests.helpers.checkpoints import load_reference, reference_generate
from tools.make_model import VOCAB_SIZE, write_model
from tools.stack import ROOT, free_port

pytestmark = pytest.mark.processes

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
STARTUP_S = 180  # a cold `make serve`: the model written, three processes, the model loaded


class Served:
    """A `make serve` on free ports, RESTART=0, its output in a log."""

    def __init__(self, log_dir: Path, *variables: str) -> None:
        self.ports = {name: free_port() for name in (
            "PORT", "HTTP_PORT", "SCHEDULER_PORT", "EXECUTOR_PORT", "ROUTER_METRICS_PORT",
            "SCHEDULER_METRICS_PORT", "EXECUTOR_METRICS_PORT")}  # fmt: skip
        self.log = log_dir / "make-serve.log"
        command = ["make", "serve", "RESTART=0", *variables,
                   *(f"{k}={v}" for k, v in self.ports.items())]  # fmt: skip
        # A process group of its own (Ctrl-C below reaches make and the supervisor),
        # in this session: a session of its own would share the CPU as one autogroup
        # beside the nice 19 numeric tests of `make test`, not yield to them.
        self.process = subprocess.Popen(
            command, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            process_group=0,
        )  # fmt: skip
        self.http = f"http://127.0.0.1:{self.ports['HTTP_PORT']}"
        self.grpc = f"127.0.0.1:{self.ports['PORT']}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.http}/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not ready in {STARTUP_S} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """Ctrl-C, as the README says: the foreground group (make, the supervisor) gets
        SIGINT (make itself ends by it) and the supervisor passes it on; every process
        drains and exits, none left behind."""
        stack = _descendants(self.process.pid)
        os.killpg(self.process.pid, signal.SIGINT)
        self.process.wait(60)
        deadline = time.monotonic() + 60
        while (left := [p for p in stack if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"still running after Ctrl-C: {left}"
        assert "Traceback" not in self.log.read_text()


def _parents() -> dict[int, int]:
    """Each process's parent (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def _descendants(root: int) -> list[int]:
    parents, found = _parents(), [root]
    for pid in found:
        found += [child for child, parent in parents.items() if parent == pid]
    return found[1:]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def quickstart_client(served: Served) -> subprocess.Popen:
    """The README's first quickstart line, on this stack's port."""
    client = [str(ROOT / ".venv" / "bin" / "flagstop-client"), "Once upon a time",
              "--max-tokens", "32", "--temperature", "0", "--addr", served.grpc]  # fmt: skip
    return subprocess.Popen(client, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def probe_until_ready(served: Served) -> list[tuple[str, int]]:
    """/ready, /v1/models and a chat completion in turn until all answer 200: each
    status, in time order (a refused connection is 0)."""
    probes = [("GET", "/ready", None), ("GET", "/v1/models", None),
              ("POST", "/v1/chat/completions",
               {"model": "flagstop-tiny", "messages": ASK, "max_tokens": 2})]  # fmt: skip
    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        for method, path, body in probes:
            try:
                answer = httpx.request(method, served.http + path, json=body, timeout=30)
                status = answer.status_code
            except httpx.TransportError:
                status = 0
            seen.append((path, status))
        if all(status == 200 for _, status in seen[-3:]):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"not serving in {STARTUP_S} s: {seen[-6:]}")


def script(text: str) -> dict:
    return {"structured_outputs": {"grammar": f"start: {json.dumps(text)}"}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The stack, the quickstart client started with it, and what the HTTP front
    answered while it started (whatever order the tests run in)."""
    served = Served(tmp_path_factory.mktemp("serve"))
    try:
        client = quickstart_client(served)  # at once, as a user would
        statuses = probe_until_ready(served)
        yield served, client, statuses
    finally:
        served.stop()


def test_the_quickstart_run_at_once_waits_for_the_stack_and_the_routes_agree_with_ready(served):
    served, client, statuses = served
    # Probed in turn, the routes change together: once one answers 200 (the stack took
    # a scheduler), none refuses any more; before, each refused (or was not up).
    first_200 = next(i for i, (_, status) in enumerate(statuses) if status == 200)
    assert statuses[0][1] != 200, "the stack was up before the first probe: nothing checked"
    assert all(status == 200 for _, status in statuses[first_200:]), statuses
    assert {status for _, status in statuses[:first_200]} <= {0, 503}
    refused = {path for path, status in statuses if status == 503}
    assert refused == {"/ready", "/v1/models", "/v1/chat/completions"}, statuses
    out, err = client.communicate(timeout=STARTUP_S)
    assert client.returncode == 0, err
    assert out.strip(), "the client printed no text"


@pytest.fixture(scope="module")
def clients(served):
    served, _, _ = served
    chat = openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=served.http, api_key="none", max_retries=0, timeout=120)
    return chat, claude


def openai_reply(chat, text: str, max_tokens: int, stream: bool) -> tuple[str, list, str]:
    """(content, [(name, arguments)], finish_reason) of a chat completion scripted to
    write text."""
    reply = chat.chat.completions.create(model="flagstop-tiny", messages=ASK, tools=TOOLS,
                                         max_tokens=max_tokens, stream=stream,
                                         extra_body=script(text))  # fmt: skip
    if not stream:
        choice = reply.choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls or ()]  # fmt: skip
        return choice.message.content or "", calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in reply:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            calls.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, [(name, json.loads(args)) for name, args in calls.values()], finish


def anthropic_reply(claude, text: str, max_tokens: int, stream: bool) -> tuple[str, list, str]:
    tool = {"name": "get_weather", "input_schema": WEATHER}
    fields = dict(model="flagstop-tiny", max_tokens=max_tokens, messages=ASK, tools=[tool],
                  extra_body=script(text))  # fmt: skip
    if stream:
        with claude.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**fields)
    content = "".join(b.text for b in message.content if b.type == "text")
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    return content, calls, message.stop_reason


OSLO = [("get_weather", {"city": "Oslo"})]
CASES = {  # output scripted, max_tokens, then what each API gives: content, calls, finish
    "a call ended without its closing tag": (CALL, 200, ("", OSLO, "tool_calls", "tool_use")),
    "a call max_tokens cut": (CALL + "</tool_call>", 20, (None, [], "length", "max_tokens")),
    "the words around a call keep their spaces": (
        f"Let me check. {CALL}</tool_call> Then", 200,
        ("Let me check.  Then", OSLO, "tool_calls", "tool_use")),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_is_never_lost_through_both_sdks(clients, case, stream):
    chat, claude = clients
    text, max_tokens, (content, calls, finish, stop_reason) = CASES[case]
    got = openai_reply(chat, text, max_tokens, stream)
    if content is None:  # cut: what was written, as content
        assert got[0] and text.startswith(got[0]) and got[1:] == ([], "length"), got
    else:
        assert got == (content, calls, finish)
    got = anthropic_reply(claude, text, max_tokens, stream)
    if content is None:
        assert got[0] and text.startswith(got[0]) and got[1:] == ([], stop_reason), got
    else:
        assert got == (content, calls, stop_reason)


def test_a_think_the_model_writes_although_the_template_opened_it_is_not_reasoning_text(
    tmp_path,
):
    """deepseek_r1: its templates open <think> in the prompt, and R1 may write it again;
    the reply's reasoning never starts with the tag, streamed or whole, in both APIs."""
    model = write_model(tmp_path / "flagstop-tiny-thinking", thinking=True)
    served = Served(tmp_path, f"MODEL={model}", "REASONING_PARSER=deepseek_r1",
                    "ROUTER_ARGS=--structured-outputs-in-reasoning")  # fmt: skip
    try:
        served.wait_ready()
        grammar = {"structured_outputs": {"grammar": f'start: <[{VOCAB_SIZE}]> "Hm, Oslo." '
                                                     f'<[{VOCAB_SIZE + 1}]> "Sunny."'}}  # fmt: skip
        chat = openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0)
        for stream in (False, True):
            reply = chat.chat.completions.create(model=model.name, messages=ASK, max_tokens=32,
                                                 stream=stream, extra_body=grammar)  # fmt: skip
            if stream:
                reasoning = content = ""
                for chunk in reply:
                    delta = chunk.choices[0].delta
                    reasoning += (delta.model_extra or {}).get("reasoning") or ""
                    content += delta.content or ""
            else:
                message = reply.choices[0].message
                reasoning, content = message.model_extra["reasoning"], message.content
            assert (reasoning, content) == ("Hm, Oslo.", "Sunny."), "the tag is not reasoning"
        claude = anthropic.Anthropic(base_url=served.http, api_key="none", max_retries=0)
        message = claude.messages.create(model=model.name, max_tokens=32, messages=ASK,
                                         extra_body=grammar)  # fmt: skip
        blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                  for b in message.content]  # fmt: skip
        assert blocks == [("thinking", "Hm, Oslo."), ("text", "Sunny.")]
    finally:
        served.stop()


def test_make_serve_arch_granite_serves_it_token_for_token_as_transformers(tmp_path):
    """docs/models.md's checklist, followed once for Granite, ends here: `make serve
    ARCH=granite` writes its checkpoint (the multipliers away from 1) and serves it,
    greedy, token for token as transformers generates on the same weights."""
    served = Served(tmp_path, "ARCH=granite")
    try:
        served.wait_ready()
        prompt = [5, 17, 42, 9, 100, 7, 31]
        reply = httpx.post(f"{served.http}/v1/completions", timeout=120, json={
            "model": "flagstop-tiny-granite", "prompt": prompt, "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True})  # fmt: skip
        assert reply.status_code == 200, reply.text
        tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
        served_ids = [int(t.removeprefix("token_id:")) for t in tokens]
        reference = load_reference(ROOT / "models" / "flagstop-tiny-granite")
        assert served_ids == reference_generate(reference, prompt, 12)
        assert len(set(served_ids)) > 1, "a degenerate model: the test could not fail"
    finally:
        served.stop()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "gemma3_vl"])
def test_make_serve_arch_vision_reads_an_image_token_for_token(tmp_path, arch):
    """The README's image quickstart: `make serve ARCH=qwen2_5_vl` (and the other
    vision-language families) writes the checkpoint and serves it; the openai SDK's
    chat with an image (a data: URL) is transformers' greedy continuation on the same
    weights and processor."""
    from tests.helpers.images import VisionReference, drawn
    from tools.make_vision_model import FAMILIES

    served = Served(tmp_path, f"ARCH={arch}")
    try:
        served.wait_ready()
        image = drawn(3)
        client = openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0)
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        reply = client.chat.completions.create(
            model=f"flagstop-tiny-{arch}", max_tokens=10, temperature=0, logprobs=True,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "Describe "},
                {"type": "image_url", "image_url": {"url": url}}]}],
            extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
        served_ids = [int(t.token.removeprefix("token_id:"))
                      for t in reply.choices[0].logprobs.content]  # fmt: skip
        reference = VisionReference(ROOT / "models" / f"flagstop-tiny-{arch}")
        text = f"<s><|user|>\nDescribe {FAMILIES[arch].image_part}\n<|assistant|>\n"
        assert served_ids == reference.greedy(text, [image], 10)
    finally:
        served.stop()


def test_make_serve_arch_qwen3_embedding_serves_sentence_transformers_embeddings(tmp_path):
    """`make serve ARCH=qwen3_embedding` writes the Qwen3-Embedding-shaped checkpoint and
    serves embeddings (docs/pooling.md): the openai SDK's and raw HTTP's equal
    sentence-transformers' on the same weights."""
    from sentence_transformers import SentenceTransformer

    served = Served(tmp_path, "ARCH=qwen3_embedding")
    try:
        served.wait_ready()
        model = "flagstop-tiny-qwen3_embedding"
        inputs = ["what keeps a GPU busy?", "continuous batching"]
        client = openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0)
        reply = client.embeddings.create(model=model, input=inputs)
        raw = httpx.post(f"{served.http}/v1/embeddings", json={"model": model, "input": inputs},
                         timeout=60).json()  # fmt: skip
        reference = SentenceTransformer(str(ROOT / "models" / model), device="cpu")
        expected = reference.encode(inputs)
        for got in ([d.embedding for d in reply.data], [d["embedding"] for d in raw["data"]]):
            np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=1e-5)
    finally:
        served.stop()


def test_make_serve_arch_qwen3_reranker_scores_as_transformers_does(tmp_path):
    """`make serve ARCH=qwen3_reranker` writes Qwen3-Reranker's layout and serves it as a
    yes/no scorer (its --hf-overrides by default): /rerank's scores, over raw HTTP and
    the openai SDK's own post, equal P(yes) by transformers on the same weights."""
    import torch
    import transformers

    from tools.make_pooling_model import rerank_document, rerank_query

    served = Served(tmp_path, "ARCH=qwen3_reranker")
    try:
        served.wait_ready()
        model = "flagstop-tiny-qwen3_reranker"
        query = rerank_query("what keeps a GPU busy?")
        documents = [rerank_document(d) for d in ("continuous batching", "the sea")]
        body = {"model": model, "query": query, "documents": documents}
        raw = httpx.post(f"{served.http}/rerank", json=body, timeout=60).json()
        client = openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0)
        sdk = client.post("/rerank", body=body, cast_to=object)
        checkpoint = str(ROOT / "models" / model)
        reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
        for reply in (raw, sdk):
            for result in reply["results"]:
                ids = tokenizer(query, documents[result["index"]]).input_ids
                with torch.no_grad():
                    last = reference(torch.tensor([ids])).logits[0, -1, [no, yes]]
                expected = last.softmax(-1)[1].item()
                assert abs(result["relevance_score"] - expected) < 1e-5, (result, expected)
    finally:
        served.stop()


def test_make_serve_arch_qwen3_classifier_classifies_as_transformers_does(tmp_path):
    """`make serve ARCH=qwen3_classifier` writes a Qwen3ForSequenceClassification and
    serves /classify: raw HTTP's and the openai SDK's probabilities equal
    transformers' on the same weights."""
    import torch
    import transformers

    served = Served(tmp_path, "ARCH=qwen3_classifier")
    try:
        served.wait_ready()
        model = "flagstop-tiny-qwen3_classifier"
        texts = ["what keeps a GPU busy?", "continuous batching"]
        body = {"model": model, "input": texts}
        raw = httpx.post(f"{served.http}/classify", json=body, timeout=60).json()
        client = openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0)
        sdk = client.post("/classify", body=body, cast_to=object)
        checkpoint = str(ROOT / "models" / model)
        reference = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoint)
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        with torch.no_grad():
            expected = [reference(**tokenizer([t], return_tensors="pt")).logits[0].softmax(-1)
                        for t in texts]  # fmt: skip
        for reply in (raw, sdk):
            got = [d["probs"] for d in reply["data"]]
            np.testing.assert_allclose(got, torch.stack(expected).numpy(), atol=1e-5)
    finally:
        served.stop()


def test_make_serve_spec_eagle3_drafts_with_a_head_token_for_token(tmp_path):
    """`make serve SPEC='{"method":"eagle3","model":HEAD}'` (docs/speculative.md): the
    embedded model drafts with an EAGLE-3 head (tools/make_eagle_head.py's, random)
    and still answers, greedy, token for token as transformers."""
    from tools.make_eagle_head import write_eagle_head

    subprocess.run(["make", "model"], cwd=ROOT, check=True, capture_output=True)
    model = ROOT / "models" / "flagstop-tiny"
    head = write_eagle_head(model, tmp_path / "head")
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    served = Served(tmp_path, f"SPEC={spec}")
    try:
        served.wait_ready()
        prompt = [5, 17, 42, 9, 100, 7, 31]
        reply = httpx.post(f"{served.http}/v1/completions", timeout=120, json={
            "model": "flagstop-tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})  # fmt: skip
        assert reply.status_code == 200, reply.text
        tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
        served_ids = [int(t.removeprefix("token_id:")) for t in tokens]
        assert served_ids == reference_generate(load_reference(model), prompt, 12)
        metrics = httpx.get(f"http://127.0.0.1:{served.ports['SCHEDULER_METRICS_PORT']}/metrics",
                            timeout=10).text  # fmt: skip
        drafts = [line for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts_total")]  # fmt: skip
        assert drafts and float(drafts[0].split()[-1]) > 0, drafts
    finally:
        served.stop()
