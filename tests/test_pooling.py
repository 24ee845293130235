"""Embeddings from a pooling model on real processes (docs/pooling.md), against
sentence-transformers on the same tiny Qwen3-Embedding-shaped checkpoint (within
1e-5): the openai SDK's embeddings.create (base64, as it asks by default) and raw
HTTP (float); a batch; inputs chunked across steps (16 tokens a step each);
prefix-cache hits on a shared prefix; preemption with recompute on a small pool;
Matryoshka dimensions; gRPC Embed; and every bad input a 400 naming it while the
others are served."""

import base64
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import openai
import pytest

from flagstop.v1 import generation_pb2
from tools.make_pooling_model import QUERY_PROMPT, write_pooling_model
from tools.stack import start_stack

pytestmark = pytest.mark.processes

MODEL = "flagstop-tiny-qwen3_embedding"
BUDGET = 64  # tokens a step, at most 16 a request: the longer inputs take many chunks
WORDS = "continuous batching keeps the accelerator busy while requests come and go "


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    return write_pooling_model(tmp_path_factory.mktemp("pooling") / MODEL)


@pytest.fixture(scope="module")
def reference(embedding_model):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_model), device="cpu")


@pytest.fixture(scope="module")
def stack(embedding_model, tmp_path_factory):
    # A pool of 40 blocks of 16 and first-chunk admission: a batch of long inputs,
    # each prefilled 16 tokens a step beside three others, outgrows it and preempts.
    budget = ["--max-num-batched-tokens", str(BUDGET)]
    stack = start_stack(embedding_model, tmp_path_factory.mktemp("logs"),
                        executor_args=["--num-blocks", "40", *budget],
                        scheduler_args=["--no-reserve-full-isl", *budget,
                                        "--long-prefill-token-threshold", "16"])  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)


def texts(n: int, words: int = 6) -> list[str]:
    return [f"{i}: " + " ".join(WORDS.split()[(i % 5) :][:words]) for i in range(n)]


def close(got, expected) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=1e-5, rtol=0)


def test_the_sdk_gets_sentence_transformers_embeddings(client, reference):
    inputs = [f"{QUERY_PROMPT}what keeps a GPU busy?", "batching", *texts(6)]
    reply = client.embeddings.create(model=MODEL, input=inputs)  # base64 on the wire
    close([d.embedding for d in reply.data], reference.encode(inputs))
    assert [d.index for d in reply.data] == list(range(len(inputs)))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(inputs)
    one = client.embeddings.create(model=MODEL, input="batching")
    close([one.data[0].embedding], reference.encode(["batching"]))


def test_raw_http_floats_token_ids_and_base64(stack, reference, embedding_model):
    url = f"{stack.base_url}/embeddings"
    tokenizer = reference.tokenizer
    ids = tokenizer("batching").input_ids
    for payload in ({"input": "batching"}, {"input": ids}, {"input": [ids, ids]}):
        body = httpx.post(url, json={"model": MODEL, **payload}, timeout=60).json()
        for entry in body["data"]:
            close([entry["embedding"]], reference.encode(["batching"]))
    body = httpx.post(url, json={"model": MODEL, "input": "batching",
                                 "encoding_format": "base64"}, timeout=60).json()  # fmt: skip
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    close([decoded], reference.encode(["batching"]))
    assert body["object"] == "list" and body["model"] == MODEL


def test_long_inputs_are_chunked_and_preempted_and_still_exact(stack, client, reference):
    """Inputs of 90-140 tokens, 16 a step each: several chunks each; sixteen at once
    outgrow the 40-block pool, so some are preempted and recomputed."""
    inputs = [f"{i} " + WORDS * (6 + i % 4) for i in range(16)]
    before = stack.stats().num_preemptions
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda chunk: client.embeddings.create(model=MODEL, input=chunk),
                                [inputs[i::4] for i in range(4)]))  # fmt: skip
    for i, reply in enumerate(replies):
        close([d.embedding for d in reply.data], reference.encode(inputs[i::4]))
    assert stack.stats().num_preemptions > before
    assert stack.wait_idle().num_running == 0


def test_a_shared_prefix_is_a_prefix_cache_hit(stack, reference):
    """A reranker's shape: one long query before each document; the second request's
    query blocks are cached, and its embeddings are the same."""
    query = f"{QUERY_PROMPT}{WORDS * 4}"
    documents = [query + d for d in texts(4)]
    stub = stack.generation()

    def embed(inputs: list[str]) -> generation_pb2.EmbedResponse:
        request = generation_pb2.EmbedRequest(
            inputs=[generation_pb2.EmbedInput(text=t) for t in inputs]
        )
        return stub.Embed(request, timeout=60)

    embed(documents[:1])
    reply = embed(documents[1:])
    assert reply.usage.cached_tokens >= 3 * 48  # three prompts' whole blocks of the query
    close([e.values for e in reply.embeddings], reference.encode(documents[1:]))


def test_dimensions_cut_and_renormalize(client, reference):
    reply = client.embeddings.create(model=MODEL, input=["batching", "go"], dimensions=64)
    expected = reference.encode(["batching", "go"], truncate_dim=64, normalize_embeddings=True)
    close([d.embedding for d in reply.data], expected)
    assert len(reply.data[0].embedding) == 64


def test_bad_inputs_are_400s_naming_them_while_others_are_served(stack, client, reference):
    url = f"{stack.base_url}/embeddings"
    cases = [
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": []}, "input"),
        ({"input": [7] * 3000}, "(3000 tokens) exceeds"),
        ({"input": "x", "dimensions": 999}, "dimensions=999"),
        ({"input": ["x"] * 2049}, "2049 inputs"),
    ]
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(client.embeddings.create, model=MODEL, input=texts(8))
        for payload, words in cases:
            reply = httpx.post(url, json={"model": MODEL, **payload}, timeout=60)
            assert reply.status_code == 400, (payload, reply.text)
            assert words in reply.json()["error"]["message"], reply.text
        close([d.embedding for d in good.result().data], reference.encode(texts(8)))
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(grpc.RpcError) as refused:
        stack.generation().Embed(
            generation_pb2.EmbedRequest(
                inputs=[generation_pb2.EmbedInput(text="x", token_ids=[3])]
            ),
            timeout=30,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stack.wait_idle().num_running == 0


def test_the_model_says_it_pools(stack):
    info = stack.generation().GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5).model
    assert list(info.pooling_tasks) == ["embed"] and info.embedding_size == 256
    assert info.matryoshka_any


def test_two_tensor_parallel_ranks_give_the_same_embeddings(embedding_model, reference, tmp_path):
    """The backbone split over two ranks (gloo): rank 0 pools the hidden states every
    rank holds after the last layer's all-reduce."""
    stack = start_stack(
        embedding_model,
        tmp_path,
        executor_args=["--tensor-parallel-size", "2", "--num-blocks", "64"],
    )
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)
        inputs = [f"{QUERY_PROMPT}what keeps a GPU busy?", *texts(5)]
        reply = client.embeddings.create(model=MODEL, input=inputs, dimensions=128)
        expected = reference.encode(inputs, truncate_dim=128, normalize_embeddings=True)
        close([d.embedding for d in reply.data], expected)
    finally:
        assert set(stack.stop().values()) == {0}
