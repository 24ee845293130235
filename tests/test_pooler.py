"""The pooling model's parts in-process (docs/pooling.md): which checkpoints pool and
how (a sequence classifier's classes, a causal LM's head cut to tokens by
--hf-overrides), the head read from the checkpoint, what the poolers make of a hidden
state, and the refusals that stop start-up naming the fault."""

import numpy as np
import pytest
import torch

from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.pooling_config import classifier_config
from flagstop.executor.models.quantization import ConfigError
from flagstop.executor.pooler import (
    ClassifierPooler,
    EmbeddingPooler,
    build_pooler,
    classifier_weight,
    pooled_outputs,
)
from flagstop.executor.sampling_params import Pooling
from tools.make_pooling_model import RERANKER, RERANKER_OVERRIDES, write_pooling_model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return write_pooling_model(tmp_path_factory.mktemp("c") / "c", arch="qwen2_classifier")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return write_pooling_model(tmp_path_factory.mktemp("r") / "r", arch=RERANKER)


def test_classes_come_from_id2label_or_num_labels():
    assert classifier_config({"id2label": {"1": "b", "0": "a"}}).labels == ("a", "b")
    three = classifier_config({"num_labels": 3})
    assert three.labels == ("LABEL_0", "LABEL_1", "LABEL_2") and not three.multi_label
    assert classifier_config({"num_labels": 1}).multi_label  # one class: a sigmoid
    tagged = classifier_config({"num_labels": 3, "problem_type": "multi_label_classification"})
    assert tagged.multi_label
    rows = classifier_config({"classifier_from_token": ["a", "b", "c"]})
    assert len(rows.labels) == 3 and rows.from_tokens == ("a", "b", "c")
    with pytest.raises(ConfigError, match="two tokens"):
        classifier_config({"classifier_from_token": ["yes"], "is_original_qwen3_reranker": True})


def test_a_sequence_classifier_pools_its_score_head(classifier):
    config = ModelConfig.from_pretrained(classifier)
    assert config.pooling.tasks == ("classify",)
    head = classifier_weight(classifier, config.pooling.classifier, config.hidden_size)
    assert head.shape == (3, config.hidden_size)


def test_hf_overrides_make_the_reranker_a_one_class_scorer(reranker):
    assert ModelConfig.from_pretrained(reranker).pooling is None  # a causal LM as it ships
    config = ModelConfig.from_pretrained(reranker, RERANKER_OVERRIDES)
    assert config.pooling.tasks == ("classify", "score")
    head = classifier_weight(reranker, config.pooling.classifier, config.hidden_size)
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(reranker / "tokenizer.json"))
    embeddings = load_file(str(reranker / "model.safetensors"))["model.embed_tokens.weight"]
    no, yes = tokenizer.token_to_id("no"), tokenizer.token_to_id("yes")
    torch.testing.assert_close(head[0], embeddings[yes] - embeddings[no])  # tied: the LM head


def test_a_token_outside_the_vocabulary_is_refused(reranker):
    overrides = RERANKER_OVERRIDES | {"classifier_from_token": ["nope", "yes"]}
    config = ModelConfig.from_pretrained(reranker, overrides)
    with pytest.raises(ConfigError, match="'nope' is not one token"):
        build_pooler(config, reranker, torch.device("cpu"))


def test_a_head_of_the_wrong_shape_is_refused(classifier, tmp_path):
    import json
    import shutil

    broken = shutil.copytree(classifier, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}  # two classes over a head of three
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"\(3, 256\), not 2 classes x 256"):
        build_pooler(ModelConfig.from_pretrained(broken), broken, torch.device("cpu"))


def test_the_classifier_pooler_gives_probabilities_or_logits():
    pooler = ClassifierPooler(torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]]), False)
    hidden = torch.tensor([[9.0, 9.0], [1.0, 1.0], [0.0, 3.0]])
    params = [Pooling("classify"), Pooling("classify", activation=False)]
    probs, logits = pooled_outputs(pooler, hidden, np.array([1, 2]), params, [False, False])
    expected = torch.tensor([1.0, 2.0, 0.0]).softmax(-1).numpy()
    np.testing.assert_allclose(np.frombuffer(probs, "<f4"), expected, rtol=1e-6)
    np.testing.assert_allclose(np.frombuffer(logits, "<f4"), [0.0, 6.0, 0.0])
    one = ClassifierPooler(torch.tensor([[1.0, -1.0]]), True)  # one class: a sigmoid
    (score,) = one.pooled(torch.tensor([[2.0, 1.0]]), [Pooling("score")])
    assert np.frombuffer(score, "<f4")[0] == pytest.approx(1 / (1 + np.exp(-1.0)))


def test_the_embedding_pooler_cuts_then_normalizes_and_a_failed_row_is_empty():
    pooler = EmbeddingPooler(normalize=True)
    hidden = torch.tensor([[3.0, 4.0, 12.0]])
    params = [Pooling(dimensions=2), Pooling(normalize=False)]
    cut, failed = pooled_outputs(pooler, hidden, np.array([0, 0]), params, [False, True])
    np.testing.assert_allclose(np.frombuffer(cut, "<f4"), [0.6, 0.8], rtol=1e-6)
    assert failed == b""
