"""Classification, scoring and reranking on real processes (docs/pooling.md), against
transformers on the same tiny checkpoints (within 1e-5): sequence classifiers of the
three families (/classify, gRPC Classify), and Qwen3-Reranker's layout served as a
yes/no scorer by --hf-overrides (/score, /rerank in Jina's and Cohere's shapes, gRPC
Score): batches, inputs chunked across steps, a shared query's prefix-cache hits,
preemption with recompute on a small pool, TP=2, and every bad input a 400 naming
it while the others are served."""

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import torch

from flagstop.v1 import generation_pb2
from tools.make_pooling_model import (
    CLASSIFIERS,
    RERANKER,
    RERANKER_OVERRIDES,
    SENTIMENTS,
    rerank_document,
    rerank_query,
    write_pooling_model,
)
from tools.stack import start_stack

pytestmark = pytest.mark.processes

# 64 tokens a step, at most 16 a request: a reranker's prompt (~260 tokens with the
# embedded vocabulary, which spells its chat tokens byte by byte) takes many chunks.
BUDGET = ["--max-num-batched-tokens", "64"]
CHUNKED = ["--no-reserve-full-isl", *BUDGET, "--long-prefill-token-threshold", "16"]
WORDS = "continuous batching keeps the accelerator busy while requests come and go "
DOCUMENTS = ["continuous batching", "the sea and the wind", "paged attention", "one two three",
             "a small model learned to count", "prefix caching reuses blocks"]  # fmt: skip


def close(got, expected) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=1e-5, rtol=0)


def http_root(stack) -> str:
    return stack.base_url.removesuffix("/v1")


# -- classifiers ---------------------------------------------------------------------


def classifier_reference(model_dir):
    """A text's logits by transformers' ForSequenceClassification, and its tokenizer."""
    import transformers

    reference = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def logits(text: str) -> np.ndarray:
        with torch.no_grad():
            return reference(**tokenizer([text], return_tensors="pt")).logits[0].numpy()

    logits.tokenizer = tokenizer
    return logits


def probs(logits: np.ndarray) -> np.ndarray:
    return torch.tensor(logits).softmax(-1).numpy()


@pytest.mark.parametrize("arch", sorted(CLASSIFIERS))
def test_a_classifier_gives_transformers_probabilities(arch, tmp_path):
    """Each family's sequence classifier: /classify on a batch (one input long enough
    for several chunks) and on token ids, the logits without activation, gRPC
    Classify finding a repeated input cached; eight long inputs at once on a pool of
    24 blocks, preempted and recomputed; /score and /v1/embeddings refused, naming
    what it does."""
    model_dir = write_pooling_model(tmp_path / arch, arch=arch)
    logits = classifier_reference(model_dir)
    tokenizer = logits.tokenizer
    stack = start_stack(model_dir, tmp_path / "logs",
                        executor_args=[*BUDGET, "--num-blocks", "24"],
                        scheduler_args=CHUNKED)  # fmt: skip
    try:
        url = f"{http_root(stack)}/classify"
        texts = ["continuous batching", "the sea", WORDS * 3]
        body = httpx.post(url, json={"model": arch, "input": texts}, timeout=60).json()
        for text, entry in zip(texts, body["data"], strict=True):
            expected = probs(logits(text))
            close(entry["probs"], expected)
            assert entry["label"] == SENTIMENTS[int(expected.argmax())]
            assert entry["num_classes"] == 3
        assert body["usage"]["prompt_tokens"] > 30 and body["object"] == "list"
        ids = tokenizer("the sea").input_ids
        raw = httpx.post(url, json={"model": arch, "input": ids, "use_activation": False},
                         timeout=60).json()  # fmt: skip
        close(raw["data"][0]["probs"], logits("the sea"))
        reply = stack.generation().Classify(generation_pb2.ClassifyRequest(
            inputs=[generation_pb2.EmbedInput(text="the sea")]), timeout=60)  # fmt: skip
        close(reply.classifications[0].probs, body["data"][1]["probs"])
        long = generation_pb2.ClassifyRequest(inputs=[generation_pb2.EmbedInput(text=WORDS * 3)])
        again = stack.generation().Classify(long, timeout=60)
        assert again.usage.cached_tokens >= 48  # its full blocks, from the batch above
        close(again.classifications[0].probs, body["data"][2]["probs"])
        before = stack.stats().num_preemptions
        longer = [f"{i}: {WORDS * (3 + i % 3)}" for i in range(8)]  # ~80-130 tokens each
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda t: httpx.post(
                url, json={"model": arch, "input": t}, timeout=60).json(), longer))  # fmt: skip
        for text, reply in zip(longer, replies, strict=True):
            close(reply["data"][0]["probs"], probs(logits(text)))
        assert stack.stats().num_preemptions > before
        refused = httpx.post(f"{http_root(stack)}/score", timeout=60,
                             json={"model": arch, "text_1": "a", "text_2": "b"})  # fmt: skip
        assert refused.status_code == 400 and "3 classes" in refused.text, refused.text
        refused = httpx.post(f"{stack.base_url}/embeddings", json={"model": arch, "input": "a"},
                             timeout=60)  # fmt: skip
        assert refused.status_code == 400 and "no embeddings" in refused.text, refused.text
        info = stack.generation().GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)
        assert list(info.model.labels) == list(SENTIMENTS)
        assert list(info.model.pooling_tasks) == ["classify"]
    finally:
        assert set(stack.stop().values()) == {0}


# -- the reranker --------------------------------------------------------------------


@pytest.fixture(scope="module")
def reranker_model(tmp_path_factory):
    return write_pooling_model(tmp_path_factory.mktemp("reranker") / RERANKER, arch=RERANKER)


@pytest.fixture(scope="module")
def reference(reranker_model):
    """Qwen3-Reranker's model card's score: P(yes) of "no" and "yes" at the last
    position, by transformers' causal LM on the pair's tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(reranker_model).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(reranker_model)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])

    def on_ids(ids: list[int], activation: bool = True) -> float:
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1, [no, yes]]
        return last.softmax(-1)[1].item() if activation else (last[1] - last[0]).item()

    def scores(query: str, documents: list[str], activation: bool = True) -> np.ndarray:
        return np.array([on_ids(tokenizer(query, d).input_ids, activation) for d in documents],
                        np.float32)  # fmt: skip

    scores.tokenizer, scores.on_ids = tokenizer, on_ids
    return scores


@pytest.fixture(scope="module")
def stack(reranker_model, tmp_path_factory):
    # A pool of 48 blocks of 16 (768 tokens) and first-chunk admission: eight prompts
    # past the shared instruction (~200 tokens), each ~100 tokens of its own prefilled
    # 16 a step, outgrow it.
    overrides = ["--hf-overrides", json.dumps(RERANKER_OVERRIDES)]
    stack = start_stack(reranker_model, tmp_path_factory.mktemp("logs"),
                        executor_args=[*overrides, "--num-blocks", "48", *BUDGET],
                        scheduler_args=CHUNKED)  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


def rerank(stack, **body) -> dict:
    reply = httpx.post(f"{http_root(stack)}/rerank", json={"model": RERANKER, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_rerank_ranks_by_the_yes_no_score(stack, reference):
    query, documents = rerank_query("what keeps a GPU busy?"), [rerank_document(d)
                                                                for d in DOCUMENTS]  # fmt: skip
    expected = reference(query, documents)
    body = rerank(stack, query=query, documents=documents)
    order = [r["index"] for r in body["results"]]
    assert order == sorted(range(len(documents)), key=lambda i: -expected[i])
    close([r["relevance_score"] for r in body["results"]], expected[order])
    assert body["results"][0]["document"] == {"text": documents[order[0]]}
    assert body["usage"]["total_tokens"] > len(documents) * 200
    cohere = [{"text": d} for d in documents]  # Cohere's documents: objects
    top = rerank(stack, query=query, documents=cohere, top_n=2, return_documents=False)
    assert [r["index"] for r in top["results"]] == order[:2]
    assert "document" not in top["results"][0]
    for route in ("/v1/rerank", "/v2/rerank"):
        reply = httpx.post(f"{http_root(stack)}{route}", timeout=60, json={
            "model": RERANKER, "query": query, "documents": documents[:2]}).json()  # fmt: skip
        close(sorted(r["relevance_score"] for r in reply["results"]), sorted(expected[:2]))


def test_score_one_against_many_pairwise_and_logits(stack, reference):
    queries = [rerank_query(q) for q in ("what keeps a GPU busy?", "what is paged attention?")]
    documents = [rerank_document(d) for d in DOCUMENTS[:2]]
    url = f"{http_root(stack)}/score"
    body = httpx.post(url, timeout=60, json={
        "model": RERANKER, "text_1": queries[0], "text_2": documents}).json()  # fmt: skip
    close([d["score"] for d in body["data"]], reference(queries[0], documents))
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "score"
    body = httpx.post(url, timeout=60, json={
        "model": RERANKER, "text_1": queries, "text_2": documents}).json()  # fmt: skip
    close(
        [d["score"] for d in body["data"]],
        [reference(q, [d])[0] for q, d in zip(queries, documents, strict=True)],
    )
    body = httpx.post(
        url,
        timeout=60,
        json={
            "model": RERANKER,
            "text_1": queries[0],
            "text_2": documents[0],
            "use_activation": False,
        },
    ).json()
    close([body["data"][0]["score"]], reference(queries[0], documents[:1], activation=False))


def test_a_shared_query_is_a_prefix_cache_hit(stack, reference):
    """gRPC Score: the second request's prompts find the query's blocks cached."""
    query = rerank_query("what does the scheduler own?")
    stub = stack.generation()

    def score(documents: list[str]) -> generation_pb2.ScoreResponse:
        return stub.Score(generation_pb2.ScoreRequest(
            queries=[generation_pb2.EmbedInput(text=query)],
            documents=[generation_pb2.EmbedInput(text=rerank_document(d)) for d in documents],
        ), timeout=60)  # fmt: skip

    score(DOCUMENTS[:1])
    reply = score(DOCUMENTS[1:4])
    query_blocks = len(reference.tokenizer(query).input_ids) // 16 * 16
    assert reply.usage.cached_tokens >= 3 * query_blocks > 0
    close(
        [s.score for s in reply.scores],
        reference(query, [rerank_document(d) for d in DOCUMENTS[1:4]]),
    )
    ids = reference.tokenizer(query).input_ids, reference.tokenizer("busy").input_ids
    by_ids = stub.Score(generation_pb2.ScoreRequest(  # token ids: the query's, then the document's
        queries=[generation_pb2.EmbedInput(token_ids=ids[0])],
        documents=[generation_pb2.EmbedInput(token_ids=ids[1])]), timeout=60)  # fmt: skip
    close([by_ids.scores[0].score], [reference.on_ids(ids[0] + ids[1])])
    assert [s.index for s in reply.scores] == [0, 1, 2]


def test_long_pairs_are_chunked_and_preempted_and_still_exact(stack, reference):
    """Eight pairs of different queries at once, 16 tokens a step each: the pool of
    768 tokens cannot hold them, so some are preempted and recomputed."""
    queries = [rerank_query(f"{i}: {WORDS * (3 + i % 3)}") for i in range(8)]
    document = rerank_document(DOCUMENTS[0])
    before = stack.stats().num_preemptions

    def score(query: str) -> float:
        body = httpx.post(f"{http_root(stack)}/score", timeout=60, json={
            "model": RERANKER, "text_1": query, "text_2": document}).json()  # fmt: skip
        return body["data"][0]["score"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(score, queries))
    close(got, [reference(q, [document])[0] for q in queries])
    assert stack.stats().num_preemptions > before
    assert stack.wait_idle().num_running == 0


def test_bad_inputs_are_400s_naming_them_while_others_are_served(stack, reference):
    query = rerank_query("q")
    cases = [
        ("/rerank", {"query": query, "documents": []}, "no documents"),
        ("/rerank", {"query": query, "documents": ["fine", ""]}, "documents[1] is empty"),
        ("/rerank", {"query": "", "documents": ["x"]}, "query[0] is empty"),
        ("/rerank", {"query": query, "documents": ["x " * 3000]}, "documents[0]: "),
        ("/rerank", {"query": query, "documents": ["x"] * 2049}, "2049 inputs"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "2 text_1 for 3 text_2"),
        ("/rerank", {"query": query, "documents": ["x"], "top_n": -1}, "top_n"),
        ("/v1/embeddings", {"input": "x"}, "makes no embeddings"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "generates no text"),
    ]
    documents = [rerank_document(d) for d in DOCUMENTS]
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(rerank, stack, query=query, documents=documents)
        for route, payload, words in cases:
            reply = httpx.post(f"{http_root(stack)}{route}", json={"model": RERANKER, **payload},
                               timeout=60)  # fmt: skip
            assert reply.status_code == 400, (route, payload, reply.text)
            assert words in reply.text, reply.text
        results = sorted(good.result()["results"], key=lambda r: r["index"])
        close([r["relevance_score"] for r in results], reference(query, documents))
    with pytest.raises(grpc.RpcError) as refused:
        stack.generation().Embed(generation_pb2.EmbedRequest(
            inputs=[generation_pb2.EmbedInput(text="x")]), timeout=30)  # fmt: skip
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "scoring model" in refused.value.details()
    assert stack.wait_idle().num_running == 0


def test_two_tensor_parallel_ranks_give_the_same_scores(reranker_model, reference, tmp_path):
    """The decoder split over two ranks (gloo); rank 0 applies the head, read whole
    from the checkpoint whatever the LM head's split."""
    overrides = ["--hf-overrides", json.dumps(RERANKER_OVERRIDES)]
    stack = start_stack(reranker_model, tmp_path,
                        executor_args=[*overrides, "--tensor-parallel-size", "2",
                                       "--num-blocks", "128"])  # fmt: skip
    try:
        query, documents = rerank_query("busy?"), [rerank_document(d) for d in DOCUMENTS[:3]]
        results = sorted(rerank(stack, query=query, documents=documents)["results"],
                         key=lambda r: r["index"])  # fmt: skip
        close([r["relevance_score"] for r in results], reference(query, documents))
    finally:
        assert set(stack.stop().values()) == {0}


def test_a_classifier_on_two_tensor_parallel_ranks(tmp_path):
    model_dir = write_pooling_model(tmp_path / "qwen3_classifier", arch="qwen3_classifier")
    logits = classifier_reference(model_dir)
    tp = ["--tensor-parallel-size", "2", "--num-blocks", "64"]
    stack = start_stack(model_dir, tmp_path / "logs", executor_args=tp)
    try:
        texts = ["continuous batching", WORDS * 2]
        body = httpx.post(f"{http_root(stack)}/classify", timeout=60,
                          json={"model": "qwen3_classifier", "input": texts}).json()  # fmt: skip
        close([d["probs"] for d in body["data"]], [probs(logits(t)) for t in texts])
    finally:
        assert set(stack.stop().values()) == {0}
