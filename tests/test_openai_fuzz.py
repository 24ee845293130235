"""A schemathesis run over the router's own /openapi.json against a real stack:
bounded, seeded examples of every operation, and none may answer 5xx; every
refusal under /v1 is an OpenAI error object. A short --max-model-len keeps each
generation brief. (Driven by hand, one hypothesis run per operation: schemathesis'
own pytest plugin, from_fixture, does not run under pytest 9.)"""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tools.stack import start_stack

pytestmark = pytest.mark.processes

MODEL = "flagstop-tiny"


@pytest.fixture(scope="module")
def fuzzed_stack(model_dir, tmp_path_factory):
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("logs"), executor_args=["--num-blocks", "64"],
        scheduler_args=["--max-model-len", "48"], router_args=["--tool-call-parser", "hermes"],
    )  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}
    log = (stack.log_dir / "router.log").read_text()
    assert "Traceback" not in log and "failed:" not in log, log[-3000:]


OPERATIONS = [
    "GET /v1/models", "GET /v1/models/{model_id}", "POST /v1/completions",
    "POST /v1/chat/completions", "POST /v1/responses", "POST /tokenize", "POST /detokenize",
    "GET /tokenizer_info", "GET /health", "GET /ready", "POST /v1/completions/render",
    "POST /v1/chat/completions/render", "POST /v1/embeddings",
]  # fmt: skip


@pytest.fixture(scope="module")
def api_schema(fuzzed_stack):
    root = fuzzed_stack.base_url.removesuffix("/v1")
    return schemathesis.openapi.from_url(f"{root}/openapi.json")


def test_every_operation_is_fuzzed(api_schema):
    labels = {r.ok().label for r in api_schema.get_all_operations()}
    assert labels >= set(OPERATIONS), labels


# Positive examples fit the schema; negative ones break it somewhere (where there is a
# body to break).
RUNS = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, GenerationMode.NEGATIVE) for label in OPERATIONS if label.startswith("POST")
]


@pytest.mark.parametrize(("label", "mode"), RUNS, ids=[f"{lb} {m.value}" for lb, m in RUNS])
def test_no_input_gets_a_5xx(api_schema, label, mode):
    operation = api_schema.find_operation_by_label(label)

    # Seeded (derandomize): the same examples every run, whatever order the tests run in.
    @given(case=operation.as_strategy(mode))
    @settings(max_examples=20, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def examples(case) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # else nearly every example stops at the model check
        response = case.call(timeout=60)
        assert response.status_code < 500, (case.body, response.text[:500])
        if response.status_code >= 400 and case.path.startswith("/v1"):
            error = response.json()["error"]
            assert error["message"] and error["type"], error

    examples()
