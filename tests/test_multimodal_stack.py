"""Images through the three services on loopback (docs/multimodal.md): the openai
SDK's chat with an image (a data: URL, or fetched from a loopback HTTP server), the
Responses API's input_image, Anthropic's image blocks and the gRPC GenerateRequest, each
token-exact against transformers; every bad image a 400 naming the part while other
requests complete; the encoder's accounting in /v1/models and the metrics."""

import base64
import http.server
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from flagstop.v1 import generation_pb2
from tests.helpers.images import VisionReference, data_url, drawn
from tests.helpers.metrics import scrape
from tools.make_vision_model import FAMILIES, IMAGE_PART, write_vision_model
from tools.stack import free_port, start_stack

pytestmark = pytest.mark.processes

MODEL = "flagstop-tiny-qwen2_5_vl"
MAX_TOKENS = 8


class Images(http.server.BaseHTTPRequestHandler):
    """/N.png: drawn(N); /slow: an image after 3 s; /page: text/html; else 404."""

    def do_GET(self):
        if self.path == "/slow":
            time.sleep(3)
        if self.path == "/page":
            return self._send(b"<html></html>", "text/html")
        if self.path.endswith(".png") or self.path == "/slow":
            seed = int(self.path[1:].removesuffix(".png")) if self.path != "/slow" else 1
            return self._send(drawn(seed), "image/png")
        self.send_error(404)

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return write_vision_model(tmp_path_factory.mktemp("vl") / MODEL)


@pytest.fixture(scope="module")
def vl_reference(vl_model):
    return VisionReference(vl_model)


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("images")
    (path / "7.png").write_bytes(drawn(7))
    return path


@pytest.fixture(scope="module")
def stack(vl_model, local_dir, tmp_path_factory):
    stack = start_stack(vl_model, tmp_path_factory.mktemp("logs"), router_args=[
        "--limit-mm-per-prompt", '{"image": 2}', "--media-fetch-timeout-s", "1",
        "--media-max-pixels", "160000", "--allowed-local-media-path", str(local_dir),
    ])  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)


def prompt(*parts: str) -> str:
    """The embedded template's rendering of one user message."""
    return f"<s><|user|>\n{''.join(parts)}\n<|assistant|>\n"


def chat_tokens(client, content: list, model: str = MODEL, **extra) -> tuple[list[int], object]:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
        **extra,
    )
    tokens = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    return tokens, reply


def ask(url: str) -> list:
    return [{"type": "text", "text": "What is in "},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": " this picture?"}]  # fmt: skip


def test_a_chat_with_an_image_equals_transformers(client, vl_reference):
    tokens, reply = chat_tokens(client, ask(data_url(drawn(1))))
    text = prompt("What is in ", IMAGE_PART, " this picture?")
    assert tokens == vl_reference.greedy(text, [drawn(1)], MAX_TOKENS)
    assert reply.usage.prompt_tokens > len(text) // 4  # the image's tokens counted


def test_two_images_and_a_jpeg_equal_transformers(client, vl_reference):
    jpeg = drawn(2, 90, 60, "JPEG")
    content = [{"type": "text", "text": "Compare "},
               {"type": "image_url", "image_url": {"url": data_url(jpeg, "image/jpeg")}},
               {"type": "text", "text": " with "},
               {"type": "image_url", "image_url": {"url": data_url(drawn(3))}}]  # fmt: skip
    tokens, _ = chat_tokens(client, content)
    text = prompt("Compare ", IMAGE_PART, " with ", IMAGE_PART)
    assert tokens == vl_reference.greedy(text, [jpeg, drawn(3)], MAX_TOKENS)


def test_a_fetched_image_equals_its_data_url(client, image_server):
    fetched, _ = chat_tokens(client, ask(f"{image_server}/4.png"))
    assert fetched == chat_tokens(client, ask(data_url(drawn(4))))[0]


def test_a_file_url_is_read_under_the_allowed_path_only(client, local_dir):
    tokens, _ = chat_tokens(client, ask(f"file://{local_dir}/7.png"))
    assert tokens == chat_tokens(client, ask(data_url(drawn(7))))[0]
    with pytest.raises(openai.BadRequestError, match="outside --allowed-local-media-path"):
        chat_tokens(client, ask("file:///etc/hostname"))


def test_responses_and_messages_take_images(stack, client):
    expected = (
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": ask(data_url(drawn(5)))}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        .choices[0]
        .message.content
    )
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=MAX_TOKENS,
                                       input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is in "},
        {"type": "input_image", "image_url": data_url(drawn(5))},
        {"type": "input_text", "text": " this picture?"}]}])  # fmt: skip
    assert response.output_text == expected
    image = base64.b64encode(drawn(5)).decode()
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "What is in "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": image}},
            {"type": "text", "text": " this picture?"}]}]}  # fmt: skip
    reply = httpx.post(f"{stack.base_url}/messages", json=body, timeout=60).json()
    assert reply["content"][0]["text"] == expected


def test_grpc_generate_with_an_image_equals_transformers(stack, vl_reference):
    request = generation_pb2.GenerateRequest(
        prompt=prompt("What is in ", IMAGE_PART, " this picture?").removeprefix("<s>"),
        images=[generation_pb2.ImageInput(data=drawn(8))], max_tokens=MAX_TOKENS,
        temperature=0, ignore_eos=True,
    )  # fmt: skip
    tokens = [t for chunk in stack.generation().Generate(request, timeout=60)
              for t in chunk.token_ids]  # fmt: skip
    text = prompt("What is in ", IMAGE_PART, " this picture?")
    assert tokens == vl_reference.greedy(text, [drawn(8)], MAX_TOKENS)


def broken(kind: str) -> str:
    return {
        "corrupt": data_url(b"\x89PNG not really"),
        "truncated": data_url(drawn(1)[:300]),
        "text": "data:text/plain;base64,aGVsbG8=",
        "base64": "data:image/png;base64,@@@",
        "large": data_url(drawn(1, 500, 400)),
        "ftp": "ftp://example.com/a.png",
    }[kind]


BAD = [
    ("corrupt", "not an image this server reads"),
    ("truncated", "does not decode"),
    ("text", "not an image/* type"),
    ("base64", "base64 does not decode"),
    ("large", "more than --media-max-pixels"),
    ("ftp", "data:, http(s): or file:"),
]


@pytest.mark.parametrize(("kind", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_image_is_a_400_naming_its_part_while_others_complete(stack, client, kind,
                                                                    message):  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(chat_tokens, client, ask(data_url(drawn(9))))
        with pytest.raises(openai.BadRequestError) as refused:
            chat_tokens(client, ask(broken(kind)))
        assert len(good.result(timeout=60)[0]) == MAX_TOKENS
    assert message in str(refused.value) and "messages[0].content[1]" in str(refused.value)


def test_fetch_failures_and_too_many_images_are_400s(stack, client, image_server):
    cases = [(ask(f"{image_server}/slow"), "--media-fetch-timeout-s"),
             (ask(f"{image_server}/missing.gif"), "HTTP 404"),
             (ask(f"{image_server}/page"), "not an image"),
             (ask(f"file://{image_server}/x.png"), "allowed"),
             (ask(f"http://127.0.0.1:{free_port()}/closed.png"), "failed"),
             (ask(data_url(drawn(1))) * 3, "--limit-mm-per-prompt")]  # fmt: skip
    for content, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            chat_tokens(client, content)
    stack.wait_idle()


def test_the_encoder_is_accounted_in_models_and_metrics(stack, client):
    [card] = httpx.get(f"{stack.base_url}/models", timeout=10).json()["data"]
    assert card["input_modalities"] == ["text", "image"]
    assert card["limit_mm_per_prompt"] == {"image": 2} and card["encoder_cache_size"] > 0
    chat_tokens(client, ask(data_url(drawn(11))))
    before = stack.stats()
    chat_tokens(client, ask(data_url(drawn(11))))  # the same image: no encoder work
    after = stack.stats()
    assert after.num_encoded_images == before.num_encoded_images
    assert after.encoder_cache_hits == before.encoder_cache_hits + 1 or \
        after.prefix_cache_hits > before.prefix_cache_hits  # fmt: skip
    metrics = scrape(stack.metrics_ports["scheduler"])
    assert any(k.startswith("flagstop:encoder_images_total") and v > 0
               for k, v in metrics.items())  # fmt: skip


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_family_on_two_tensor_parallel_ranks_reads_images_token_exact(arch, tmp_path):
    """Each family through the services, the language model split over two ranks and
    the vision tower on each (replicated): chunks around (Qwen's: across) the image,
    and the same image again (no encoder work)."""
    model_dir = write_vision_model(tmp_path / f"flagstop-tiny-{arch}", arch=arch)
    reference = VisionReference(model_dir)
    tp = start_stack(model_dir, tmp_path / "logs", executor_args=["--tensor-parallel-size", "2"],
                     scheduler_args=["--max-num-batched-tokens", "24"])  # fmt: skip
    try:
        client = openai.OpenAI(base_url=tp.base_url, api_key="none", max_retries=0, timeout=60)
        text = prompt("What is in ", FAMILIES[arch].image_part, " this picture?")
        expected = reference.greedy(text, [drawn(12)], MAX_TOKENS)
        for _ in range(2):
            tokens, _ = chat_tokens(client, ask(data_url(drawn(12))),
                                    model=f"flagstop-tiny-{arch}")  # fmt: skip
            assert tokens == expected
        assert tp.stats().num_encoded_images == 1  # again: a prefix or encoder cache hit
    finally:
        assert set(tp.stop().values()) == {0}


def test_the_host_tier_keeps_image_prefixes_by_their_images(vl_model, vl_reference, tmp_path):
    """A pool of 24 blocks and a host tier: an image prompt's blocks, evicted from the
    pool by other prompts, load back from the tier for the same image, and never for
    another image at the same positions (its blocks' hashes differ)."""
    stack = start_stack(vl_model, tmp_path, executor_args=[
        "--num-blocks", "24", "--kv-offload-bytes", str(64 << 20)])  # fmt: skip
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)
        words = "A continuous batching server keeps the accelerator busy at every step. " * 2
        content = [{"type": "text", "text": words}, *ask(data_url(drawn(13)))]
        first, _ = chat_tokens(client, content)
        for seed in range(3):  # evict it from the pool
            client.completions.create(model=MODEL, prompt=[0] + [3 + (seed * 7 + i) % 500
                                      for i in range(150)], max_tokens=4)  # fmt: skip
        before = stack.stats().external_prefix_cache_hits
        other = [{"type": "text", "text": words}, *ask(data_url(drawn(14)))]
        text = prompt(words, "What is in ", IMAGE_PART, " this picture?")
        assert chat_tokens(client, other)[0] == vl_reference.greedy(text, [drawn(14)], MAX_TOKENS)
        loaded_for_other = stack.stats().external_prefix_cache_hits - before
        assert loaded_for_other > 0  # the text before the image: the same blocks
        assert chat_tokens(client, content)[0] == first
        # Its text blocks are in the pool again (the other request's); the blocks over
        # and after its image come from the tier.
        loaded_again = stack.stats().external_prefix_cache_hits - before - loaded_for_other
        assert loaded_again >= 16
        stack.wait_idle()
    finally:
        assert set(stack.stop().values()) == {0}


def test_a_killed_executor_is_sent_the_images_of_the_requests_it_had(stack, vl_reference):
    """kill -9 of the executor mid-stream: the new one gets the pixels of every request
    still in flight before its first step, and the stream goes on token-exact."""
    text = prompt("What is in ", IMAGE_PART, " this picture?")
    request = generation_pb2.GenerateRequest(
        prompt=text.removeprefix("<s>"), images=[generation_pb2.ImageInput(data=drawn(15))],
        max_tokens=300, temperature=0, ignore_eos=True)  # fmt: skip
    tokens: list[int] = []

    def stream():
        for chunk in stack.generation().Generate(request, timeout=120):
            tokens.extend(chunk.token_ids)

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(stream)
        deadline = time.monotonic() + 30
        while len(tokens) < 5:
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.005)
        stack.kill("executor")
        stack.restart("executor")
        done.result(timeout=120)
    assert tokens == vl_reference.greedy(text, [drawn(15)], 300)
    stack.wait_idle(30)


def test_grpc_images_that_are_refused_name_their_field(stack):
    import grpc

    bad = generation_pb2.GenerateRequest(
        prompt=f"Look: {IMAGE_PART}", max_tokens=4, images=[generation_pb2.ImageInput(data=b"junk")]
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(stack.generation().Generate(bad, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "images[0]" in refused.value.details()
    ids = generation_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3], max_tokens=4, images=[generation_pb2.ImageInput(data=drawn(1))]
    )
    with pytest.raises(grpc.RpcError, match="text prompt"):
        list(stack.generation().Generate(ids, timeout=30))
