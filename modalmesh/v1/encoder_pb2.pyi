from modalmesh.v1 import common_pb2 as _common_pb2
from modalmesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeItem(_message.Message):
    __slots__ = ("data", "pixels", "pcm", "video", "sample_rate", "min_pixels", "max_pixels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    pixels: _tensor_pb2.Tensor
    pcm: _tensor_pb2.Tensor
    video: bytes
    sample_rate: int
    min_pixels: int
    max_pixels: int
    def __init__(self, data: _Optional[bytes] = ..., pixels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., pcm: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., video: _Optional[bytes] = ..., sample_rate: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("items", "request_id", "transfer")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    request_id: str
    transfer: TransferOptions
    def __init__(self, items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ..., request_id: _Optional[str] = ..., transfer: _Optional[_Union[TransferOptions, _Mapping]] = ...) -> None: ...

class TransferOptions(_message.Message):
    __slots__ = ("shm_probe", "shm_nonce", "cuda_ipc")
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    shm_probe: str
    shm_nonce: bytes
    cuda_ipc: bool
    def __init__(self, shm_probe: _Optional[str] = ..., shm_nonce: _Optional[bytes] = ..., cuda_ipc: bool = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("embedding", "grid_thw", "num_placeholder_tokens", "valid_length", "cache_hit", "second_per_grid_t")
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_PLACEHOLDER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VALID_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_T_FIELD_NUMBER: _ClassVar[int]
    embedding: _tensor_pb2.Tensor
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_placeholder_tokens: int
    valid_length: int
    cache_hit: bool
    second_per_grid_t: float
    def __init__(self, embedding: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_placeholder_tokens: _Optional[int] = ..., valid_length: _Optional[int] = ..., cache_hit: bool = ..., second_per_grid_t: _Optional[float] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings", "model_id", "weights_fingerprint", "modality")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    model_id: str
    weights_fingerprint: str
    modality: _common_pb2.Modality
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., model_id: _Optional[str] = ..., weights_fingerprint: _Optional[str] = ..., modality: _Optional[_Union[_common_pb2.Modality, str]] = ...) -> None: ...
