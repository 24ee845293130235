from flagstop.v1 import executor_pb2 as _executor_pb2
from flagstop.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestFinish(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_FINISH_UNSPECIFIED: _ClassVar[RequestFinish]
    REQUEST_FINISH_STOP: _ClassVar[RequestFinish]
    REQUEST_FINISH_LENGTH: _ClassVar[RequestFinish]
    REQUEST_FINISH_ABORT: _ClassVar[RequestFinish]
    REQUEST_FINISH_ERROR: _ClassVar[RequestFinish]
    REQUEST_FINISH_TRANSFER: _ClassVar[RequestFinish]
REQUEST_FINISH_UNSPECIFIED: RequestFinish
REQUEST_FINISH_STOP: RequestFinish
REQUEST_FINISH_LENGTH: RequestFinish
REQUEST_FINISH_ABORT: RequestFinish
REQUEST_FINISH_ERROR: RequestFinish
REQUEST_FINISH_TRANSFER: RequestFinish

class DescribeSchedulerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeSchedulerResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: _generation_pb2.ModelInfo
    def __init__(self, model: _Optional[_Union[_generation_pb2.ModelInfo, _Mapping]] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "priority", "arrival_time", "traceparent", "labels", "num_speculative_tokens", "lora_name", "kv_transfer", "lora_id", "slo_ttft_ms", "slo_tpot_ms", "tenant", "request_class", "media", "media_data", "retention", "cache_salt", "session_id")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    MEDIA_DATA_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _executor_pb2.SamplingParams
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    arrival_time: float
    traceparent: str
    labels: _containers.ScalarMap[str, str]
    num_speculative_tokens: int
    lora_name: str
    kv_transfer: KVTransferParams
    lora_id: str
    slo_ttft_ms: float
    slo_tpot_ms: float
    tenant: str
    request_class: str
    media: _containers.RepeatedCompositeFieldContainer[_generation_pb2.MediaPlaceholder]
    media_data: _containers.RepeatedCompositeFieldContainer[_generation_pb2.MediaData]
    retention: _generation_pb2.Retention
    cache_salt: str
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_executor_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., arrival_time: _Optional[float] = ..., traceparent: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., num_speculative_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ..., lora_id: _Optional[str] = ..., slo_ttft_ms: _Optional[float] = ..., slo_tpot_ms: _Optional[float] = ..., tenant: _Optional[str] = ..., request_class: _Optional[str] = ..., media: _Optional[_Iterable[_Union[_generation_pb2.MediaPlaceholder, _Mapping]]] = ..., media_data: _Optional[_Iterable[_Union[_generation_pb2.MediaData, _Mapping]]] = ..., retention: _Optional[_Union[_generation_pb2.Retention, _Mapping]] = ..., cache_salt: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("do_remote_decode", "remote_endpoint", "remote_engine_id", "transfer_id", "remote_block_ids", "num_remote_tokens")
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    do_remote_decode: bool
    remote_endpoint: str
    remote_engine_id: str
    transfer_id: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_remote_tokens: int
    def __init__(self, do_remote_decode: _Optional[bool] = ..., remote_endpoint: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., num_remote_tokens: _Optional[int] = ...) -> None: ...

class RouterMessage(_message.Message):
    __slots__ = ("router_id", "adds", "aborts", "num_queued")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    adds: _containers.RepeatedCompositeFieldContainer[AddRequest]
    aborts: _containers.RepeatedScalarFieldContainer[str]
    num_queued: int
    def __init__(self, router_id: _Optional[str] = ..., adds: _Optional[_Iterable[_Union[AddRequest, _Mapping]]] = ..., aborts: _Optional[_Iterable[str]] = ..., num_queued: _Optional[int] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("step_id", "request_ids", "token_ids", "logprobs", "finished_ids", "finish_reasons", "errors", "credits", "load", "prompt_logprobs", "num_cached_tokens", "kv_transfers", "pooled")
    class KvTransfersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: KVTransferParams
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[KVTransferParams, _Mapping]] = ...) -> None: ...
    class PooledEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    finished_ids: _containers.RepeatedScalarFieldContainer[str]
    finish_reasons: _containers.RepeatedScalarFieldContainer[RequestFinish]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    credits: int
    load: ReplicaLoad
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_executor_pb2.PromptLogprobs]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    kv_transfers: _containers.MessageMap[str, KVTransferParams]
    pooled: _containers.ScalarMap[str, bytes]
    def __init__(self, step_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., finished_ids: _Optional[_Iterable[str]] = ..., finish_reasons: _Optional[_Iterable[_Union[RequestFinish, str]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., credits: _Optional[int] = ..., load: _Optional[_Union[ReplicaLoad, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_executor_pb2.PromptLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., kv_transfers: _Optional[_Mapping[str, KVTransferParams]] = ..., pooled: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "running_loras", "waiting_loras", "lora_adapters_version", "num_host_cached_blocks", "external_prefix_cache_hits", "executor_lost", "prefix_cache_queries", "prefix_cache_hits")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_LORAS_FIELD_NUMBER: _ClassVar[int]
    WAITING_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_LOST_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    running_loras: _containers.RepeatedScalarFieldContainer[str]
    waiting_loras: _containers.RepeatedScalarFieldContainer[str]
    lora_adapters_version: int
    num_host_cached_blocks: int
    external_prefix_cache_hits: int
    executor_lost: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., running_loras: _Optional[_Iterable[str]] = ..., waiting_loras: _Optional[_Iterable[str]] = ..., lora_adapters_version: _Optional[int] = ..., num_host_cached_blocks: _Optional[int] = ..., external_prefix_cache_hits: _Optional[int] = ..., executor_lost: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("step_id", "num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "executor_connected", "remote_policy_active", "remote_policy_failures", "num_routers", "num_loading", "external_prefix_cache_queries", "external_prefix_cache_hits", "num_host_blocks", "num_host_cached_blocks", "num_kv_leases", "policy", "num_shed", "num_ignored_decisions", "shadow_policy", "shadow_decisions", "shadow_agreed", "shadow_would_shed", "num_held_steps", "encoder_cache_used_tokens", "encoder_cache_size", "num_encoded_images", "num_encoded_tokens", "encoder_cache_hits", "num_retained_blocks", "num_retentions", "retention_hits", "retained_evictions", "retention_expiries", "num_cached_blocks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    REMOTE_POLICY_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_POLICY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADING_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LEASES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_SHED_FIELD_NUMBER: _ClassVar[int]
    NUM_IGNORED_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_POLICY_FIELD_NUMBER: _ClassVar[int]
    SHADOW_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_AGREED_FIELD_NUMBER: _ClassVar[int]
    SHADOW_WOULD_SHED_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETENTIONS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_HITS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    executor_connected: bool
    remote_policy_active: bool
    remote_policy_failures: int
    num_routers: int
    num_loading: int
    external_prefix_cache_queries: int
    external_prefix_cache_hits: int
    num_host_blocks: int
    num_host_cached_blocks: int
    num_kv_leases: int
    policy: str
    num_shed: int
    num_ignored_decisions: int
    shadow_policy: str
    shadow_decisions: int
    shadow_agreed: int
    shadow_would_shed: int
    num_held_steps: int
    encoder_cache_used_tokens: int
    encoder_cache_size: int
    num_encoded_images: int
    num_encoded_tokens: int
    encoder_cache_hits: int
    num_retained_blocks: int
    num_retentions: int
    retention_hits: int
    retained_evictions: int
    retention_expiries: int
    num_cached_blocks: int
    def __init__(self, step_id: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., executor_connected: _Optional[bool] = ..., remote_policy_active: _Optional[bool] = ..., remote_policy_failures: _Optional[int] = ..., num_routers: _Optional[int] = ..., num_loading: _Optional[int] = ..., external_prefix_cache_queries: _Optional[int] = ..., external_prefix_cache_hits: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_host_cached_blocks: _Optional[int] = ..., num_kv_leases: _Optional[int] = ..., policy: _Optional[str] = ..., num_shed: _Optional[int] = ..., num_ignored_decisions: _Optional[int] = ..., shadow_policy: _Optional[str] = ..., shadow_decisions: _Optional[int] = ..., shadow_agreed: _Optional[int] = ..., shadow_would_shed: _Optional[int] = ..., num_held_steps: _Optional[int] = ..., encoder_cache_used_tokens: _Optional[int] = ..., encoder_cache_size: _Optional[int] = ..., num_encoded_images: _Optional[int] = ..., num_encoded_tokens: _Optional[int] = ..., encoder_cache_hits: _Optional[int] = ..., num_retained_blocks: _Optional[int] = ..., num_retentions: _Optional[int] = ..., retention_hits: _Optional[int] = ..., retained_evictions: _Optional[int] = ..., retention_expiries: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy", "policy_addr", "shadow")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_ADDR_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    policy: str
    policy_addr: str
    shadow: str
    def __init__(self, policy: _Optional[str] = ..., policy_addr: _Optional[str] = ..., shadow: _Optional[str] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("policy", "shadow_policy")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SHADOW_POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    shadow_policy: str
    def __init__(self, policy: _Optional[str] = ..., shadow_policy: _Optional[str] = ...) -> None: ...
