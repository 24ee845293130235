from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolingTask(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TASK_UNSPECIFIED: _ClassVar[PoolingTask]
    POOLING_TASK_EMBED: _ClassVar[PoolingTask]
    POOLING_TASK_CLASSIFY: _ClassVar[PoolingTask]
    POOLING_TASK_SCORE: _ClassVar[PoolingTask]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class KVRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_ROLE_BOTH: _ClassVar[KVRole]
    KV_ROLE_PREFILL: _ClassVar[KVRole]
    KV_ROLE_DECODE: _ClassVar[KVRole]
POOLING_TASK_UNSPECIFIED: PoolingTask
POOLING_TASK_EMBED: PoolingTask
POOLING_TASK_CLASSIFY: PoolingTask
POOLING_TASK_SCORE: PoolingTask
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
KV_ROLE_BOTH: KVRole
KV_ROLE_PREFILL: KVRole
KV_ROLE_DECODE: KVRole

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "path", "id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    id: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_inplace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_inplace: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class LoadLoRAAdapterResponse(_message.Message):
    __slots__ = ("rank", "modules", "id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    modules: _containers.RepeatedScalarFieldContainer[str]
    id: str
    def __init__(self, rank: _Optional[int] = ..., modules: _Optional[_Iterable[str]] = ..., id: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "priority", "logprobs", "labels", "structured_outputs", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "logit_bias", "prompt_logprobs", "num_speculative_tokens", "lora_name", "slo_ttft_ms", "slo_tpot_ms", "tenant", "request_class", "images", "retention", "cache_salt", "session_id", "pooling")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    priority: int
    logprobs: int
    labels: _containers.ScalarMap[str, str]
    structured_outputs: StructuredOutputs
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    num_speculative_tokens: int
    lora_name: str
    slo_ttft_ms: float
    slo_tpot_ms: float
    tenant: str
    request_class: str
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    retention: Retention
    cache_salt: str
    session_id: str
    pooling: PoolingParams
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[int] = ..., logprobs: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., slo_ttft_ms: _Optional[float] = ..., slo_tpot_ms: _Optional[float] = ..., tenant: _Optional[str] = ..., request_class: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ..., cache_salt: _Optional[str] = ..., session_id: _Optional[str] = ..., pooling: _Optional[_Union[PoolingParams, _Mapping]] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("task", "dimensions", "normalize", "activation")
    TASK_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    task: PoolingTask
    dimensions: int
    normalize: bool
    activation: bool
    def __init__(self, task: _Optional[_Union[PoolingTask, str]] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., activation: _Optional[bool] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "dimensions", "normalize", "lora_name", "labels", "priority", "cache_salt", "tenant", "request_class")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    dimensions: int
    normalize: bool
    lora_name: str
    labels: _containers.ScalarMap[str, str]
    priority: int
    cache_salt: str
    tenant: str
    request_class: str
    def __init__(self, inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., lora_name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ..., request_class: _Optional[str] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "usage")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("inputs", "activation", "lora_name", "labels", "priority", "cache_salt", "tenant", "request_class")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    activation: bool
    lora_name: str
    labels: _containers.ScalarMap[str, str]
    priority: int
    cache_salt: str
    tenant: str
    request_class: str
    def __init__(self, inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., activation: _Optional[bool] = ..., lora_name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ..., request_class: _Optional[str] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("classifications", "usage")
    CLASSIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    classifications: _containers.RepeatedCompositeFieldContainer[Classification]
    usage: Usage
    def __init__(self, classifications: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("probs", "label")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    label: str
    def __init__(self, probs: _Optional[_Iterable[float]] = ..., label: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("queries", "documents", "activation", "lora_name", "labels", "priority", "cache_salt", "tenant", "request_class", "ranked", "top_n")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    RANKED_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    documents: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    activation: bool
    lora_name: str
    labels: _containers.ScalarMap[str, str]
    priority: int
    cache_salt: str
    tenant: str
    request_class: str
    ranked: bool
    top_n: int
    def __init__(self, queries: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., documents: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., activation: _Optional[bool] = ..., lora_name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ..., request_class: _Optional[str] = ..., ranked: _Optional[bool] = ..., top_n: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "usage")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[DocumentScore]
    usage: Usage
    def __init__(self, scores: _Optional[_Iterable[_Union[DocumentScore, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class DocumentScore(_message.Message):
    __slots__ = ("index", "score")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class Retention(_message.Message):
    __slots__ = ("priority", "ttl_s", "num_tokens")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    priority: int
    ttl_s: float
    num_tokens: int
    def __init__(self, priority: _Optional[int] = ..., ttl_s: _Optional[float] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class MediaPlaceholder(_message.Message):
    __slots__ = ("hash", "offset", "length", "grid")
    HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    offset: int
    length: int
    grid: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., grid: _Optional[_Iterable[int]] = ...) -> None: ...

class MediaData(_message.Message):
    __slots__ = ("hash", "pixel_values", "shape", "dtype", "grid")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    pixel_values: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    grid: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hash: _Optional[bytes] = ..., pixel_values: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., grid: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "strict", "after_token_ids", "force_after_within", "open_token_ids", "num_prompt_tokens_constrained")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORCE_AFTER_WITHIN_FIELD_NUMBER: _ClassVar[int]
    OPEN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    strict: bool
    after_token_ids: _containers.RepeatedScalarFieldContainer[int]
    force_after_within: int
    open_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens_constrained: int
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., strict: _Optional[bool] = ..., after_token_ids: _Optional[_Iterable[int]] = ..., force_after_within: _Optional[int] = ..., open_token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens_constrained: _Optional[int] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stop_reason", "usage", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_model_len", "eos_token_ids", "block_size", "num_blocks", "lora_adapters", "max_loras", "num_host_blocks", "kv_role", "kv_layout", "kv_layers", "kv_capacity_tokens", "accepts_images", "max_num_encoder_input_tokens", "encoder_cache_size", "pixel_dtype", "bidirectional_images", "retention_share", "max_retention_s", "pooling_tasks", "embedding_size", "matryoshka_dimensions", "matryoshka_any", "labels")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_ENCODER_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIXEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BIDIRECTIONAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SHARE_FIELD_NUMBER: _ClassVar[int]
    MAX_RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    POOLING_TASKS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_ANY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_blocks: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    max_loras: int
    num_host_blocks: int
    kv_role: KVRole
    kv_layout: str
    kv_layers: _containers.RepeatedCompositeFieldContainer[KVCacheLayer]
    kv_capacity_tokens: int
    accepts_images: bool
    max_num_encoder_input_tokens: int
    encoder_cache_size: int
    pixel_dtype: str
    bidirectional_images: bool
    retention_share: float
    max_retention_s: float
    pooling_tasks: _containers.RepeatedScalarFieldContainer[str]
    embedding_size: int
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    matryoshka_any: bool
    labels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ..., max_loras: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., kv_role: _Optional[_Union[KVRole, str]] = ..., kv_layout: _Optional[str] = ..., kv_layers: _Optional[_Iterable[_Union[KVCacheLayer, _Mapping]]] = ..., kv_capacity_tokens: _Optional[int] = ..., accepts_images: _Optional[bool] = ..., max_num_encoder_input_tokens: _Optional[int] = ..., encoder_cache_size: _Optional[int] = ..., pixel_dtype: _Optional[str] = ..., bidirectional_images: _Optional[bool] = ..., retention_share: _Optional[float] = ..., max_retention_s: _Optional[float] = ..., pooling_tasks: _Optional[_Iterable[str]] = ..., embedding_size: _Optional[int] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., matryoshka_any: _Optional[bool] = ..., labels: _Optional[_Iterable[str]] = ...) -> None: ...

class KVCacheLayer(_message.Message):
    __slots__ = ("attention", "sliding_window", "sinks", "kv_bytes_per_token")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SINKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    attention: str
    sliding_window: int
    sinks: bool
    kv_bytes_per_token: int
    def __init__(self, attention: _Optional[str] = ..., sliding_window: _Optional[int] = ..., sinks: _Optional[bool] = ..., kv_bytes_per_token: _Optional[int] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...
