"""The optional API keys: a bearer token in the `authorization` metadata of every
Generation call and header of every OpenAI API call (Anthropic's clients send it as
`x-api-key`). Health, readiness, reflection and metrics stay open so that probes and
scrapers need no key.

Two kinds of key, both optional: the operator's one `--api-key`, and the tenants'
`--tenant-keys` file (docs/sessions.md), each key of which binds its requests to its
tenant: their tenant is the key's whatever they claim, and their cache salt starts
from it, so that two tenants never share a cached block."""

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import grpc

from flagstop.v1 import generation_pb2

PROTECTED = "/" + generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name + "/"
REFUSAL = "missing or wrong API key: send 'authorization: Bearer <key>'"
# Between a tenant and a client's own salt: a client's salt has no control characters
# (the APIs refuse them), so no salt a client sends can be a tenant's.
SALT_SEPARATOR = "\x1f"


def read_tenant_keys(path: Path) -> dict[str, str]:
    """The file's {"KEY": "TENANT", ...}; ValueError says what is wrong with it."""
    try:
        keys = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(keys, dict) or not keys:
        raise ValueError(f'{path} must hold a JSON object {{"KEY": "TENANT", ...}}')
    for key, tenant in keys.items():
        if not key or not isinstance(tenant, str) or not tenant or not tenant.isprintable():
            raise ValueError(f"{path}: each key must be non-empty and name a tenant (a "
                             f"non-empty printable string); {tenant!r} does not")  # fmt: skip
    return keys


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """The cache salt of a request under a tenant's key."""
    return f"{tenant}{SALT_SEPARATOR}{cache_salt}"


def _digest(token: str | bytes) -> bytes:
    # Keys are looked up by their digest: a lookup's time tells nothing of how much of
    # a guess was right (the constant-time comparison's purpose), whatever the number.
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class ApiKeys:
    """The keys a request may show, and the tenant each binds ("": the operator's
    key, which binds none). With no key at all every request passes."""

    __slots__ = ("tenants",)

    def __init__(self, api_key: str | None = None, tenant_keys: dict[str, str] | None = None):
        self.tenants = {_digest(f"Bearer {k}"): t for k, t in (tenant_keys or {}).items()}
        if api_key:
            self.tenants[_digest(f"Bearer {api_key}")] = ""

    @classmethod
    def from_settings(cls, settings) -> "ApiKeys":
        tenant_keys = read_tenant_keys(settings.tenant_keys) if settings.tenant_keys else None
        api_key = settings.api_key.get_secret_value() if settings.api_key else None
        return cls(api_key, tenant_keys)

    @property
    def required(self) -> bool:
        return bool(self.tenants)

    def matches(self, given: str | bytes | None) -> bool:
        return not self.tenants or _digest(given or b"") in self.tenants

    def tenant_of(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The tenant the request's key binds ("": none)."""
        if not self.tenants:
            return ""
        headers = {k.lower(): v for k, v in metadata}
        given = headers.get("authorization") or f"Bearer {headers.get('x-api-key', '')}"
        return self.tenants.get(_digest(given), "")


NO_KEYS = ApiKeys()


class ApiKeyCheck(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        return handler if self.keys.matches(given) else _deny(handler)


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        _refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
