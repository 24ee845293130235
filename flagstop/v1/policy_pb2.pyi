from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "priority", "arrival_time", "labels", "prefix_hit_blocks")
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
    request_id: str
    prompt_tokens: int
    priority: int
    arrival_time: float
    labels: _containers.ScalarMap[str, str]
    prefix_hit_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., arrival_time: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., prefix_hit_blocks: _Optional[int] = ...) -> None: ...

class PolicyQuery(_message.Message):
    __slots__ = ("query_id", "waiting", "running", "num_free_blocks", "num_total_blocks")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    waiting: _containers.RepeatedCompositeFieldContainer[PolicyRequest]
    running: _containers.RepeatedCompositeFieldContainer[PolicyRequest]
    num_free_blocks: int
    num_total_blocks: int
    def __init__(self, query_id: _Optional[int] = ..., waiting: _Optional[_Iterable[_Union[PolicyRequest, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[PolicyRequest, _Mapping]]] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ...) -> None: ...

class PolicyDecision(_message.Message):
    __slots__ = ("admission_order", "preemption_order")
    ADMISSION_ORDER_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_ORDER_FIELD_NUMBER: _ClassVar[int]
    admission_order: _containers.RepeatedScalarFieldContainer[str]
    preemption_order: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, admission_order: _Optional[_Iterable[str]] = ..., preemption_order: _Optional[_Iterable[str]] = ...) -> None: ...
