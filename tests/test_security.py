"""Mutual TLS on every link, the API key, message-size limits, and fuzzed requests:
no input takes a process down, every one gets a valid status."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flagstop import health
from flagstop.server import CHANNEL_OPTIONS, TLSConfig
from flagstop.v1 import generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.helpers.certs import have_openssl, make_ca, make_cert
from tools.stack import generate, start_stack

pytestmark = pytest.mark.processes  # every test here runs processes

API_KEY = "s3cret-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if not have_openssl():
        pytest.skip("the openssl command makes the test certificates; it is not installed")
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue_ca = make_ca(directory, "flagstop-ca"), make_ca(directory, "rogue-ca")
    names = ("executor", "scheduler", "router", "client")
    pki = {name: make_cert(directory, name, ca) for name in names}
    pki["rogue"] = make_cert(directory, "rogue", rogue_ca)
    pki["ca"] = ca
    return pki


def tls_args(pki, name: str) -> list[str]:
    cert, key = pki[name]
    return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(pki["ca"])]


def credentials(pki, name: str | None) -> grpc.ChannelCredentials:
    """The CA to trust the servers, and a client certificate (None: no certificate)."""
    ca = pki["ca"].read_bytes()
    if name is None:
        return grpc.ssl_channel_credentials(ca)
    cert, key = pki[name]
    return grpc.ssl_channel_credentials(ca, key.read_bytes(), cert.read_bytes())


@pytest.fixture(scope="module")
def tls_stack(model_dir, pki, tmp_path_factory):
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("tls"),
        executor_args=["--num-blocks", "256", *tls_args(pki, "executor")],
        scheduler_args=tls_args(pki, "scheduler"),
        router_args=[*tls_args(pki, "router"), "--tls-require-client-cert"],
        env={"FLAGSTOP_ROUTER_API_KEY": API_KEY},
        channel_credentials=credentials(pki, "client"),
    )  # fmt: skip
    yield stack
    assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


def call_generate(address: str, creds: grpc.ChannelCredentials | None, metadata=AUTH) -> list:
    channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt_token_ids=[0, 5, 6], max_tokens=3)
        chunks = stub.Generate(request, metadata=metadata, timeout=10)
        return [t for chunk in chunks for t in chunk.token_ids]


def test_every_link_is_mutual_tls_and_a_good_client_is_served(tls_stack, pki):
    assert len(call_generate(tls_stack.router, credentials(pki, "client"))) == 3
    stats = tls_stack.stats()  # the scheduler over mTLS
    assert stats.executor_connected  # and it reached the executor over mTLS


@pytest.mark.parametrize("client", ["rogue", None, "plaintext"])
def test_a_client_without_a_certificate_of_our_ca_is_refused_on_every_port(tls_stack, pki, client):
    creds = None if client == "plaintext" else credentials(pki, client)
    for address in (tls_stack.router, tls_stack.scheduler, tls_stack.executor):
        channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        with channel, pytest.raises(grpc.RpcError) as error:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, address


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),),
                                      (("authorization", API_KEY),)])  # fmt: skip
def test_a_missing_or_wrong_api_key_is_unauthenticated(tls_stack, pki, metadata):
    with pytest.raises(grpc.RpcError) as error:
        call_generate(tls_stack.router, credentials(pki, "client"), metadata)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in error.value.details()


def test_the_http_api_is_tls_with_client_certificates_and_the_key(tls_stack, pki):
    import ssl

    import httpx

    url = f"https://{tls_stack.http}/v1/completions"
    body = {"model": "flagstop-tiny", "prompt": [0, 5, 6], "max_tokens": 3}
    cert, key = pki["client"]
    good = ssl.create_default_context(cafile=str(pki["ca"]))
    good.load_cert_chain(cert, key)
    headers = {"authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(url, json=body, headers=headers, verify=good, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    assert httpx.post(url, json=body, verify=good, timeout=30).status_code == 401
    no_cert = ssl.create_default_context(cafile=str(pki["ca"]))
    with pytest.raises(httpx.HTTPError):  # the handshake wants a client certificate
        httpx.post(url, json=body, headers=headers, verify=no_cert, timeout=30)
    with pytest.raises(httpx.HTTPError):  # plaintext to a TLS port
        httpx.post(url.replace("https", "http"), json=body, headers=headers, timeout=30)


def test_health_needs_no_api_key(tls_stack):
    reply = health_pb2_grpc.HealthStub(tls_stack.channel(tls_stack.router)).Check(
        health_pb2.HealthCheckRequest(), timeout=5
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_health_command_speaks_tls(tls_stack, pki):
    cert, key = pki["client"]
    tls = TLSConfig(cert.read_bytes(), key.read_bytes(), pki["ca"].read_bytes())
    assert health.check(tls_stack.scheduler, tls=tls)
    assert not health.check(tls_stack.scheduler, timeout=1)


# -- bad input ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("fuzz"), executor_args=["--num-blocks", "256"],
        router_args=["--max-request-bytes", "65536"],
    )  # fmt: skip
    yield stack
    assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


def test_a_message_over_the_size_limit_is_resource_exhausted(stack):
    with pytest.raises(grpc.RpcError) as error:
        generate(stack, prompt="x" * 70_000, max_tokens=1)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(generate(stack, prompt_token_ids=[0, 4], max_tokens=2)[0]) == 2


INT32 = st.integers(-(2**31), 2**31 - 1)
SMALL_OR_EXTREME = st.one_of(st.integers(-3, 8), INT32)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
requests = st.builds(
    generation_pb2.GenerateRequest,
    prompt=st.one_of(st.just(""), st.text(max_size=300)),
    prompt_token_ids=st.lists(st.one_of(st.integers(-2, 600), INT32), max_size=40),
    temperature=st.one_of(st.none(), FLOATS, st.just(0.0)),
    top_p=st.one_of(st.none(), FLOATS),
    top_k=st.one_of(st.just(0), SMALL_OR_EXTREME),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    max_tokens=SMALL_OR_EXTREME,
    min_tokens=st.one_of(st.just(0), SMALL_OR_EXTREME),
    stop=st.lists(st.text(max_size=50), max_size=40),
    stop_token_ids=st.lists(st.one_of(st.integers(-2, 600), INT32), max_size=40),
    ignore_eos=st.booleans(),
    priority=INT32,
    logprobs=st.one_of(st.none(), st.integers(-2, 25), INT32),
    labels=st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=8),
)
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests)
def fuzz(stub, request):
    try:
        for chunk in stub.Generate(request, timeout=10):
            assert len(chunk.token_ids) <= 1  # one step's token per chunk
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    assert code in ACCEPTABLE, (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert len(details) > 10  # a message a person can act on


def test_fuzzed_requests_get_a_valid_status_and_leave_the_stack_healthy_and_idle(stack):
    """One test, so that the check after the fuzzing always comes after it, whatever
    the order the tests run in."""
    with grpc.insecure_channel(stack.router, options=CHANNEL_OPTIONS) as channel:
        fuzz(generation_pb2_grpc.GenerationStub(channel))
    for address in (stack.router, stack.scheduler, stack.executor):
        reply = health_pb2_grpc.HealthStub(stack.channel(address)).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    tokens, _, last = generate(stack, prompt_token_ids=[0, 7, 8], max_tokens=4, ignore_eos=True)
    assert len(tokens) == 4 and last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    stack.wait_idle()
    stats = scheduler_pb2_grpc.SchedulerStub(stack.channel(stack.scheduler)).GetStats(
        scheduler_pb2.GetStatsRequest(), timeout=5
    )
    assert stats.num_free_blocks == stats.num_total_blocks


def test_tenant_keys_bind_their_tenant_and_the_operators_key_binds_none():
    from flagstop.router.auth import NO_KEYS, ApiKeys

    keys = ApiKeys("operator", {"sk-acme": "acme", "sk-globex": "globex"})
    assert keys.required and not NO_KEYS.required and NO_KEYS.matches(None)
    assert keys.matches("Bearer sk-acme") and keys.matches(b"Bearer operator")
    assert not keys.matches("Bearer sk-acm") and not keys.matches(None)
    assert keys.tenant_of([("authorization", "Bearer sk-acme")]) == "acme"
    assert keys.tenant_of([("x-api-key", "sk-globex")]) == "globex"  # Anthropic's header
    assert keys.tenant_of([("Authorization", "Bearer operator")]) == ""
    assert keys.tenant_of([]) == "" and NO_KEYS.tenant_of([("x-api-key", "sk-acme")]) == ""


printable = st.text(st.characters(codec="utf-8").filter(str.isprintable), max_size=12)


@given(printable.filter(bool), printable.filter(bool), printable, printable)
def test_no_salt_a_client_sends_is_a_tenants_and_tenants_never_share_one(t1, t2, s1, s2):
    from flagstop.router.auth import tenant_salt

    assert not tenant_salt(t1, s1).isprintable()  # a client's salt must be printable
    assert (tenant_salt(t1, s1) == tenant_salt(t2, s2)) == (t1 == t2 and s1 == s2)
