"""A windowed model through the three processes (what `make serve ARCH=gpt_oss` runs):
the executor describes its layers, the scheduler builds the groups from them and says
so (Describe, /v1/models, its metrics), a prompt past the window comes back token-exact,
and a host tier with groups stops start-up in one line."""

import random
import urllib.request

import httpx
import pytest

from tests.helpers.checkpoints import load_reference, reference_generate
from tests.helpers.streams import assert_evicted_prefix_loads_back
from tools.make_model import write_model
from tools.stack import generate, scheduler_refusal, start_stack

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gpt-oss") / "m", "tiny", arch="gpt_oss")


@pytest.fixture(scope="module")
def stack(gpt_oss, tmp_path_factory):
    stack = start_stack(gpt_oss, tmp_path_factory.mktemp("logs"),
                        executor_args=["--num-blocks", "201"])  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


def test_the_groups_are_described_and_a_long_prompt_is_token_exact(stack, gpt_oss):
    [card] = httpx.get(f"{stack.base_url}/models", timeout=30).json()["data"]
    assert card["kv_cache_groups"] == "full x2 + window 128 x2"
    # fp32, 2 KV heads of 64 on 4 layers: 2 x 4 x 2 x 64 x 4 bytes.
    assert card["kv_bytes_per_token"] == 4096
    # 200 usable blocks: the window group's window and a chunk, the rest full attention.
    assert 0 < card["kv_capacity_tokens"] < 200 * 16
    rng = random.Random(3)
    prompt = [1, *(rng.randrange(3, 500) for _ in range(299))]  # past the 128-token window
    tokens, _, _ = generate(stack, prompt_token_ids=prompt, max_tokens=24, temperature=0,
                            ignore_eos=True)  # fmt: skip
    assert tokens == reference_generate(load_reference(gpt_oss), prompt, 24)
    metrics = (
        urllib.request.urlopen(
            f"http://127.0.0.1:{stack.metrics_ports['scheduler']}/metrics", timeout=30
        )
        .read()
        .decode()
    )
    assert 'groups="full x2 + window 128 x2"' in metrics and 'kv_bytes_per_token="4096"' in metrics


def test_a_prefix_the_pool_evicted_loads_back_from_the_host_tier_in_every_group(
    gpt_oss, tmp_path
):  # fmt: skip
    # 48 blocks, two groups: a 300-token prompt holds 19 full and ~10 window blocks.
    args = ["--num-blocks", "48", "--kv-offload-bytes", str(64 << 20)]
    stack = start_stack(gpt_oss, tmp_path, executor_args=args)
    try:  # 300 tokens: 18 whole blocks, 256 tokens of them at least from the tier
        assert_evicted_prefix_loads_back(stack, load_reference(gpt_oss), 300, 251, 256, seed=11)
    finally:
        stack.stop(10)


def test_disaggregation_with_groups_stops_start_up_naming_the_way_out(gpt_oss):
    args = ["--num-blocks", "64", "--kv-role", "prefill", "--kv-transfer-host", "127.0.0.1"]
    returncode, last_line = scheduler_refusal(gpt_oss, args)
    assert returncode != 0
    assert "--disable-hybrid-kv-cache-manager" in last_line
