from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "priority", "arrival_time", "labels", "prefix_hit_blocks", "computed_tokens", "output_tokens", "max_tokens", "first_token_time", "slo_ttft_ms", "slo_tpot_ms", "tenant", "request_class", "session_id", "retention")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    priority: int
    arrival_time: float
    labels: _containers.ScalarMap[str, str]
    prefix_hit_blocks: int
    computed_tokens: int
    output_tokens: int
    max_tokens: int
    first_token_time: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    tenant: str
    request_class: str
    session_id: str
    retention: PolicyRetention
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., arrival_time: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., prefix_hit_blocks: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., first_token_time: _Optional[float] = ..., slo_ttft_ms: _Optional[float] = ..., slo_tpot_ms: _Optional[float] = ..., tenant: _Optional[str] = ..., request_class: _Optional[str] = ..., session_id: _Optional[str] = ..., retention: _Optional[_Union[PolicyRetention, _Mapping]] = ...) -> None: ...

class PolicyRetention(_message.Message):
    __slots__ = ("priority", "ttl_s", "num_tokens")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    priority: int
    ttl_s: float
    num_tokens: int
    def __init__(self, priority: _Optional[int] = ..., ttl_s: _Optional[float] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class StepCost(_message.Message):
    __slots__ = ("base_s", "s_per_token", "s_per_context_token")
    BASE_S_FIELD_NUMBER: _ClassVar[int]
    S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    S_PER_CONTEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    base_s: float
    s_per_token: float
    s_per_context_token: float
    def __init__(self, base_s: _Optional[float] = ..., s_per_token: _Optional[float] = ..., s_per_context_token: _Optional[float] = ...) -> None: ...

class PolicyQuery(_message.Message):
    __slots__ = ("query_id", "waiting", "running", "num_free_blocks", "num_total_blocks", "now", "token_budget", "block_size", "step_cost", "max_num_seqs")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    waiting: _containers.RepeatedCompositeFieldContainer[PolicyRequest]
    running: _containers.RepeatedCompositeFieldContainer[PolicyRequest]
    num_free_blocks: int
    num_total_blocks: int
    now: float
    token_budget: int
    block_size: int
    step_cost: StepCost
    max_num_seqs: int
    def __init__(self, query_id: _Optional[int] = ..., waiting: _Optional[_Iterable[_Union[PolicyRequest, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[PolicyRequest, _Mapping]]] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., now: _Optional[float] = ..., token_budget: _Optional[int] = ..., block_size: _Optional[int] = ..., step_cost: _Optional[_Union[StepCost, _Mapping]] = ..., max_num_seqs: _Optional[int] = ...) -> None: ...

class PolicyDecision(_message.Message):
    __slots__ = ("admission_order", "preemption_order", "shed", "defer", "prefill_budget", "chunk_caps", "hold", "retain")
    class ShedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ChunkCapsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RetainEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PolicyRetention
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PolicyRetention, _Mapping]] = ...) -> None: ...
    ADMISSION_ORDER_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_ORDER_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    DEFER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CAPS_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    admission_order: _containers.RepeatedScalarFieldContainer[str]
    preemption_order: _containers.RepeatedScalarFieldContainer[str]
    shed: _containers.ScalarMap[str, str]
    defer: _containers.RepeatedScalarFieldContainer[str]
    prefill_budget: int
    chunk_caps: _containers.ScalarMap[str, int]
    hold: _containers.RepeatedScalarFieldContainer[str]
    retain: _containers.MessageMap[str, PolicyRetention]
    def __init__(self, admission_order: _Optional[_Iterable[str]] = ..., preemption_order: _Optional[_Iterable[str]] = ..., shed: _Optional[_Mapping[str, str]] = ..., defer: _Optional[_Iterable[str]] = ..., prefill_budget: _Optional[int] = ..., chunk_caps: _Optional[_Mapping[str, int]] = ..., hold: _Optional[_Iterable[str]] = ..., retain: _Optional[_Mapping[str, PolicyRetention]] = ...) -> None: ...
