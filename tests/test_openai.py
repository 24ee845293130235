"""The OpenAI-compatible HTTP front, driven by the official openai SDK against a real
stack on loopback: the same tokens as the gRPC path and transformers, streaming,
choices, stop strings, usage, logprobs, errors in OpenAI's shape, disconnects."""

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from flagstop.v1 import generation_pb2
from tests.helpers.checkpoints import reference_generate
from tools.stack import free_port, generate, spawn, start_stack, wait_serving

pytestmark = pytest.mark.processes  # every test here runs processes

MODEL = "flagstop-tiny"
PROMPT_IDS = [0, 17, 201, 33, 94, 150, 7, 300, 41, 12, 9]


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    # 100 blocks of 16: a pool of 1600 tokens, below the model's 2048.
    stack = start_stack(model_dir, tmp_path_factory.mktemp("logs"),
                        executor_args=["--num-blocks", "100"])  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)


def grpc_tokens(stack, **fields) -> tuple[list[int], str]:
    tokens, text, _ = generate(stack, **fields)
    return tokens, text


def test_models_lists_the_served_model(client):
    [model] = client.models.list().data
    assert model.id == MODEL


def test_greedy_completion_equals_the_grpc_path_and_transformers(stack, client, reference):
    expected = reference_generate(reference, PROMPT_IDS, 24)
    ids, text = grpc_tokens(stack, prompt_token_ids=PROMPT_IDS, max_tokens=24, temperature=0,
                            ignore_eos=True)  # fmt: skip
    assert ids == expected
    result = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=24, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    [choice] = result.choices
    assert [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens] == expected
    assert choice.text == text and choice.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(PROMPT_IDS), 24)
    assert result.object == "text_completion" and result.id.startswith("cmpl-")


def test_a_streamed_completion_is_the_same_text_with_exact_usage(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_renders_the_template_and_streams(stack, client, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    _, grpc_text = grpc_tokens(stack, prompt_token_ids=prompt_ids, max_tokens=12, temperature=0,
                               ignore_eos=True)  # fmt: skip
    kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == grpc_text
    assert whole.choices[0].message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), 12)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == grpc_text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_seeded_choices_are_reproducible_and_share_the_prefill(stack, client):
    prompt = [0, *range(40, 104)]  # 65 tokens: 4 full blocks of 16 to share
    before = stack.stats()
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=7, n=3,
                  extra_body={"ignore_eos": True})  # fmt: skip
    first = client.completions.create(**kwargs)
    after = stack.stats()
    second = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, "choices of one request were meant to differ"
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    # The other two choices found the first one's 4 prompt blocks in the prefix cache.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * 4 * 16
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == 48


def test_a_list_of_prompts_gives_a_choice_each(client):
    result = client.completions.create(model=MODEL, prompt=["Once upon", "The router"],
                                       max_tokens=3, temperature=0)  # fmt: skip
    assert sorted(c.index for c in result.choices) == [0, 1]


def test_stop_strings_end_the_text_before_the_match(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[10:13]
    stopped = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert stopped.text == text[: text.index(stop)] and stopped.finish_reason == "stop"


def test_logprobs_agree_with_the_grpc_path(stack, client):
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=2, ignore_eos=True
    )
    grpc_logprobs = [lp for c in stack.generation().Generate(request, timeout=60)
                     for lp in c.logprobs]  # fmt: skip
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    ).choices[0].logprobs  # fmt: skip
    assert completion.token_logprobs == pytest.approx([lp.logprob for lp in grpc_logprobs])
    assert [len(top) for top in completion.top_logprobs] == [2] * 6
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    ).choices[0].logprobs.content  # fmt: skip
    assert len(chat) == 5 and all(len(t.top_logprobs) == 3 for t in chat)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in chat)  # greedy


def post(stack, path: str, body, headers=None, content=None) -> httpx.Response:
    data = content if content is not None else json.dumps(body)
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{stack.base_url}{path}", content=data, headers=headers, timeout=60)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
BAD = [
    ("bad JSON", "/completions", None, '{"model": "flagstop-tiny", "prompt": ', 400, None),
    ("not an object", "/completions", None, "[1, 2]", 400, None),
    ("missing messages", "/chat/completions", {"model": MODEL}, None, 400, "messages"),
    ("empty messages", "/chat/completions", {**CHAT, "messages": []}, None, 400, "messages"),
    ("wrong role", "/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages.0.role"),
    ("negative max_tokens", "/completions", {**COMPLETION, "max_tokens": -1}, None, 400,
     "max_tokens"),
    ("max_tokens a string", "/completions", {**COMPLETION, "max_tokens": "ten"}, None, 400,
     "max_tokens"),
    ("temperature out of range", "/completions", {**COMPLETION, "temperature": -0.5}, None,
     400, "temperature"),
    ("top_p 0", "/completions", {**COMPLETION, "top_p": 0}, None, 400, "top_p"),
    ("top_k negative", "/completions", {**COMPLETION, "top_k": -2}, None, 400, "top_k"),
    ("stop list too long", "/completions", {**COMPLETION, "stop": [str(i) for i in range(17)]},
     None, 400, "stop"),
    ("n too large", "/completions", {**COMPLETION, "n": 17}, None, 400, "n"),
    ("logprobs too many", "/completions", {**COMPLETION, "logprobs": 21}, None, 400, "logprobs"),
    ("token id outside the vocabulary", "/completions", {**COMPLETION, "prompt": [0, 5, 512]},
     None, 400, "prompt"),
    ("prompt too long for the model", "/completions",
     {**COMPLETION, "prompt": [0] * 2040, "max_tokens": 100}, None, 400, "max_tokens"),
    ("prompt past the KV pool", "/completions",
     {**COMPLETION, "prompt": [0] * 1700, "max_tokens": 8}, None, 400, "max_tokens"),
    ("empty prompt", "/completions", {**COMPLETION, "prompt": ""}, None, 400, "prompt"),
    ("unknown model", "/completions", {**COMPLETION, "model": "gpt-9"}, None, 404, "model"),
    ("a penalty out of range", "/chat/completions", {**CHAT, "frequency_penalty": 2.5}, None,
     400, "frequency_penalty"),
    ("a tool without its function", "/chat/completions",
     {**CHAT, "tools": [{"type": "function"}]}, None, 400, "tools.0.function"),
    ("best_of we would drop", "/completions", {**COMPLETION, "best_of": 3}, None, 400, None),
    ("an image we cannot see", "/chat/completions", {**CHAT, "messages": [{"role": "user",
     "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400,
     "messages[0].content[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "path", "body", "raw", "status", "param"), BAD,
                         ids=[b[0] for b in BAD])  # fmt: skip
def test_bad_requests_get_openai_errors_while_others_complete(
    stack, client, case, path, body, raw, status, param
):
    with ThreadPoolExecutor(2) as pool:
        good = [pool.submit(client.completions.create, model=MODEL, prompt=[0, 40 + i],
                            max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
                for i in range(2)]  # fmt: skip
        reply = post(stack, path, body, content=raw)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert error["param"] == param, error
        assert all(f.result().usage.completion_tokens == 12 for f in good)


def test_an_unknown_field_is_ignored(client):
    result = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                       extra_body={"some_other_providers_flag": True,
                                                   "ignore_eos": True})  # fmt: skip
    assert result.usage.completion_tokens == 2


def test_a_huge_body_is_413(stack):
    reply = post(stack, "/completions", None, content=b"{" + b" " * (5 << 20) + b"}")
    assert reply.status_code == 413 and reply.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(stack):
    body = {"model": MODEL, "prompt": [0, 9, 8], "max_tokens": 1000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{stack.base_url}/completions", json=body, timeout=60) as reply:
        events = []
        for line in reply.iter_lines():
            if line.startswith("data:"):
                events.append(line)
            if len(events) == 5:
                break
    assert stack.stats().num_running <= 1
    stack.wait_idle(timeout=10)


def test_a_non_streaming_client_that_goes_away_frees_its_blocks(stack):
    body = {"model": MODEL, "prompt": [0, 9, 7], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.base_url}/completions", json=body, timeout=1.0)
    stack.wait_idle(timeout=10)


def test_health_ready_and_metrics_on_the_http_port(stack):
    assert httpx.get(f"http://{stack.http}/health").status_code == 200
    assert httpx.get(f"http://{stack.http}/ready").json() == {"ready": True}
    metrics = httpx.get(f"http://{stack.http}/metrics").text
    assert "vllm:time_to_first_token_seconds_bucket" in metrics


@pytest.fixture(scope="module")
def guarded(stack, model_dir, tmp_path_factory):
    """A second router on the same scheduler: an API key, and a model without a chat
    template."""
    bare = tmp_path_factory.mktemp("bare") / MODEL
    shutil.copytree(model_dir, bare)
    (bare / "chat_template.jinja").unlink()
    port, http = free_port(), free_port()
    args = ["-m", "flagstop.router", "--model", str(bare), "--scheduler", stack.scheduler,
            "--port", str(port), "--http-port", str(http), "--metrics-port", "0"]  # fmt: skip
    router = spawn("guarded", args, tmp_path_factory.mktemp("guarded"),
                   env={"FLAGSTOP_ROUTER_API_KEY": "sesame"})  # fmt: skip
    wait_serving(stack.channel(f"127.0.0.1:{port}"), router)
    yield f"http://127.0.0.1:{http}/v1"
    router.terminate()
    assert router.wait(30) == 0


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"},
                                     {"authorization": "sesame"}])  # fmt: skip
def test_a_missing_or_wrong_key_is_401(guarded, headers):
    reply = httpx.post(f"{guarded}/completions", json=COMPLETION, headers=headers)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_the_key_opens_the_api_and_probes_need_none(guarded):
    client = openai.OpenAI(base_url=guarded, api_key="sesame", max_retries=0)
    # EOS ignored: a sampled EOS would end the reply early, and its length is the check.
    reply = client.completions.create(**COMPLETION, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
    root = guarded.removesuffix("/v1")
    assert [httpx.get(f"{root}/{p}").status_code for p in ("health", "ready", "metrics")] == [
        200, 200, 200,
    ]  # fmt: skip


def test_the_openapi_schema_is_behind_the_key_too(guarded):
    root = guarded.removesuffix("/v1")
    assert httpx.get(f"{root}/openapi.json").status_code == 401
    schema = httpx.get(f"{root}/openapi.json", headers={"authorization": "Bearer sesame"}).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses"} <= set(schema["paths"])


def test_chat_without_a_template_is_400(guarded):
    reply = httpx.post(f"{guarded}/chat/completions", json=CHAT,
                       headers={"authorization": "Bearer sesame"})  # fmt: skip
    assert reply.status_code == 400 and "no chat template" in reply.json()["error"]["message"]


@pytest.fixture(scope="module")
def queue_stack(model_dir, tmp_path_factory):
    """One seat, one waiting place, one queued request: the fourth is refused."""
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("queue"), executor_args=["--num-blocks", "128"],
        scheduler_args=["--max-num-seqs", "1", "--max-waiting-requests", "1"],
        router_args=["--max-queued-requests", "1"],
    )  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


def test_a_full_admission_queue_is_429(queue_stack):
    body = {"model": MODEL, "prompt": [0, 9], "max_tokens": 300, "ignore_eos": True}
    url = f"{queue_stack.base_url}/completions"
    with ThreadPoolExecutor(3) as pool:
        admitted = [pool.submit(httpx.post, url, json=body, timeout=120)]
        while queue_stack.stats().num_running < 1:
            time.sleep(0.02)
        admitted.append(pool.submit(httpx.post, url, json=body, timeout=120))
        while queue_stack.stats().num_waiting < 1:
            time.sleep(0.02)
        admitted.append(pool.submit(httpx.post, url, json=body, timeout=120))
        time.sleep(0.3)
        refused = httpx.post(url, json=body, timeout=10)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert "admission queue is full" in refused.json()["error"]["message"]
        assert all(f.result().status_code == 200 for f in admitted)


def test_no_scheduler_is_503(model_dir, tmp_path):
    http = free_port()
    args = ["-m", "flagstop.router", "--model", str(model_dir), "--scheduler",
            f"127.0.0.1:{free_port()}", "--port", str(free_port()), "--http-port", str(http),
            "--metrics-port", "0"]  # fmt: skip
    router = spawn("lonely", args, tmp_path)
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=5)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
        assert httpx.get(f"{url}/ready").status_code == 503
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        router.terminate()
        assert router.wait(30) == 0
