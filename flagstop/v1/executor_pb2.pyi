from flagstop.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHandshakeRequest(_message.Message):
    __slots__ = ("kv_layout",)
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    kv_layout: str
    def __init__(self, kv_layout: _Optional[str] = ...) -> None: ...

class KVRegion(_message.Message):
    __slots__ = ("address", "block_bytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    address: int
    block_bytes: int
    def __init__(self, address: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class KVRank(_message.Message):
    __slots__ = ("session", "regions")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    session: str
    regions: _containers.RepeatedCompositeFieldContainer[KVRegion]
    def __init__(self, session: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[KVRegion, _Mapping]]] = ...) -> None: ...

class KVHandshakeResponse(_message.Message):
    __slots__ = ("kv_layout", "engine_id", "num_blocks", "ranks")
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    kv_layout: str
    engine_id: str
    num_blocks: int
    ranks: _containers.RepeatedCompositeFieldContainer[KVRank]
    def __init__(self, kv_layout: _Optional[str] = ..., engine_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[KVRank, _Mapping]]] = ...) -> None: ...

class RenewKVLeaseRequest(_message.Message):
    __slots__ = ("transfer_id", "engine_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    engine_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class RenewKVLeaseResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class ReleaseKVLeaseRequest(_message.Message):
    __slots__ = ("transfer_id", "engine_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    engine_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class ReleaseKVLeaseResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class PrepareGrammarRequest(_message.Message):
    __slots__ = ("structured_outputs",)
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    structured_outputs: _generation_pb2.StructuredOutputs
    def __init__(self, structured_outputs: _Optional[_Union[_generation_pb2.StructuredOutputs, _Mapping]] = ...) -> None: ...

class PrepareMediaRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_generation_pb2.MediaData]
    def __init__(self, items: _Optional[_Iterable[_Union[_generation_pb2.MediaData, _Mapping]]] = ...) -> None: ...

class PrepareMediaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepareGrammarResponse(_message.Message):
    __slots__ = ("compile_seconds",)
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    compile_seconds: float
    def __init__(self, compile_seconds: _Optional[float] = ...) -> None: ...

class DescribeExecutorRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeExecutorResponse(_message.Message):
    __slots__ = ("model", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "num_speculative_tokens", "speculative_method", "kv_endpoint", "kv_engine_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    model: _generation_pb2.ModelInfo
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    num_speculative_tokens: int
    speculative_method: str
    kv_endpoint: str
    kv_engine_id: str
    def __init__(self, model: _Optional[_Union[_generation_pb2.ModelInfo, _Mapping]] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., speculative_method: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_engine_id: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "min_tokens", "stop_token_ids", "logprobs", "structured_outputs", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "logit_bias", "prompt_logprobs", "pooling")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    structured_outputs: _generation_pb2.StructuredOutputs
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    pooling: _generation_pb2.PoolingParams
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[_generation_pb2.StructuredOutputs, _Mapping]] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., pooling: _Optional[_Union[_generation_pb2.PoolingParams, _Mapping]] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "sampling_params", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "lora_name", "media")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_name: str
    media: _containers.RepeatedCompositeFieldContainer[_generation_pb2.MediaPlaceholder]
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., media: _Optional[_Iterable[_Union[_generation_pb2.MediaPlaceholder, _Mapping]]] = ...) -> None: ...

class CachedRequestData(_message.Message):
    __slots__ = ("req_ids", "num_computed_tokens", "num_scheduled_tokens", "num_new_blocks", "new_block_ids", "num_draft_slots")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_draft_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerOutput(_message.Message):
    __slots__ = ("finished_req_ids", "preempted_req_ids", "scheduled_cached_reqs", "scheduled_new_reqs", "trimmed_req_ids", "trimmed_num_blocks", "kv_connector", "poll_kv_transfers", "encoder_inputs", "encoder_frees")
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_CACHED_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_NEW_REQS_FIELD_NUMBER: _ClassVar[int]
    TRIMMED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TRIMMED_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    POLL_KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INPUTS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_FREES_FIELD_NUMBER: _ClassVar[int]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_req_ids: _containers.RepeatedScalarFieldContainer[str]
    scheduled_cached_reqs: CachedRequestData
    scheduled_new_reqs: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    trimmed_req_ids: _containers.RepeatedScalarFieldContainer[str]
    trimmed_num_blocks: _containers.RepeatedScalarFieldContainer[int]
    kv_connector: KVConnectorMetadata
    poll_kv_transfers: bool
    encoder_inputs: _containers.RepeatedScalarFieldContainer[bytes]
    encoder_frees: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, finished_req_ids: _Optional[_Iterable[str]] = ..., preempted_req_ids: _Optional[_Iterable[str]] = ..., scheduled_cached_reqs: _Optional[_Union[CachedRequestData, _Mapping]] = ..., scheduled_new_reqs: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., trimmed_req_ids: _Optional[_Iterable[str]] = ..., trimmed_num_blocks: _Optional[_Iterable[int]] = ..., kv_connector: _Optional[_Union[KVConnectorMetadata, _Mapping]] = ..., poll_kv_transfers: _Optional[bool] = ..., encoder_inputs: _Optional[_Iterable[bytes]] = ..., encoder_frees: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVLoad(_message.Message):
    __slots__ = ("req_id", "block_ids", "source_ids", "endpoint", "engine_id", "transfer_id")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    source_ids: _containers.RepeatedScalarFieldContainer[int]
    endpoint: str
    engine_id: str
    transfer_id: str
    def __init__(self, req_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., source_ids: _Optional[_Iterable[int]] = ..., endpoint: _Optional[str] = ..., engine_id: _Optional[str] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class KVSend(_message.Message):
    __slots__ = ("transfer_id", "block_ids")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVConnectorMetadata(_message.Message):
    __slots__ = ("loads", "save_block_ids", "save_slots", "sends")
    LOADS_FIELD_NUMBER: _ClassVar[int]
    SAVE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SENDS_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[KVLoad]
    save_block_ids: _containers.RepeatedScalarFieldContainer[int]
    save_slots: _containers.RepeatedScalarFieldContainer[int]
    sends: _containers.RepeatedCompositeFieldContainer[KVSend]
    def __init__(self, loads: _Optional[_Iterable[_Union[KVLoad, _Mapping]]] = ..., save_block_ids: _Optional[_Iterable[int]] = ..., save_slots: _Optional[_Iterable[int]] = ..., sends: _Optional[_Iterable[_Union[KVSend, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "plan", "heartbeat", "traceparent")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    plan: SchedulerOutput
    heartbeat: bool
    traceparent: str
    def __init__(self, step_id: _Optional[int] = ..., plan: _Optional[_Union[SchedulerOutput, _Mapping]] = ..., heartbeat: _Optional[bool] = ..., traceparent: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "logprobs", "heartbeat", "prompt_logprobs", "num_sampled_tokens", "num_draft_tokens", "finished_recving", "failed_recving", "finished_sending", "pooled")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_RECVING_FIELD_NUMBER: _ClassVar[int]
    FAILED_RECVING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SENDING_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    heartbeat: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    num_sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    finished_recving: _containers.RepeatedScalarFieldContainer[str]
    failed_recving: _containers.RepeatedScalarFieldContainer[str]
    finished_sending: _containers.RepeatedScalarFieldContainer[str]
    pooled: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., heartbeat: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., num_sampled_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., finished_recving: _Optional[_Iterable[str]] = ..., failed_recving: _Optional[_Iterable[str]] = ..., finished_sending: _Optional[_Iterable[str]] = ..., pooled: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "first_token", "logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    first_token: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, req_id: _Optional[str] = ..., first_token: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
