from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    IMAGE: _ClassVar[Modality]
    AUDIO: _ClassVar[Modality]
    VIDEO: _ClassVar[Modality]
MODALITY_UNSPECIFIED: Modality
IMAGE: Modality
AUDIO: Modality
VIDEO: Modality

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackendRejection(_message.Message):
    __slots__ = ("backend", "reason")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    backend: str
    reason: str
    def __init__(self, backend: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AttentionChoice(_message.Message):
    __slots__ = ("component", "backend", "reason", "rejected", "rank")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    component: str
    backend: str
    reason: str
    rejected: _containers.RepeatedCompositeFieldContainer[BackendRejection]
    rank: int
    def __init__(self, component: _Optional[str] = ..., backend: _Optional[str] = ..., reason: _Optional[str] = ..., rejected: _Optional[_Iterable[_Union[BackendRejection, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "capacity_tokens", "used_tokens", "bytes", "page_size", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_tokens: int
    used_tokens: int
    bytes: int
    page_size: int
    dtype: str
    def __init__(self, name: _Optional[str] = ..., capacity_tokens: _Optional[int] = ..., used_tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("service", "version", "model_id", "architecture", "dtype", "device", "hidden_size", "output_hidden_size", "vocab_size", "max_model_len", "modality", "attention", "pools", "weights_fingerprint", "ready", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    service: str
    version: str
    model_id: str
    architecture: str
    dtype: str
    device: str
    hidden_size: int
    output_hidden_size: int
    vocab_size: int
    max_model_len: int
    modality: Modality
    attention: _containers.RepeatedCompositeFieldContainer[AttentionChoice]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    weights_fingerprint: str
    ready: bool
    extra: _containers.ScalarMap[str, str]
    def __init__(self, service: _Optional[str] = ..., version: _Optional[str] = ..., model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., hidden_size: _Optional[int] = ..., output_hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., modality: _Optional[_Union[Modality, str]] = ..., attention: _Optional[_Iterable[_Union[AttentionChoice, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ..., weights_fingerprint: _Optional[str] = ..., ready: bool = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...
