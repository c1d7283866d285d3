from modalmesh.v1 import common_pb2 as _common_pb2
from modalmesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PNG: _ClassVar[OutputFormat]
    TENSOR_UINT8: _ClassVar[OutputFormat]
    TENSOR_FLOAT: _ClassVar[OutputFormat]
PNG: OutputFormat
TENSOR_UINT8: OutputFormat
TENSOR_FLOAT: OutputFormat

class TilingOptions(_message.Message):
    __slots__ = ("mode", "tile_latent_size", "overlap_latent")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        AUTO: _ClassVar[TilingOptions.Mode]
        ON: _ClassVar[TilingOptions.Mode]
        OFF: _ClassVar[TilingOptions.Mode]
    AUTO: TilingOptions.Mode
    ON: TilingOptions.Mode
    OFF: TilingOptions.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    TILE_LATENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_LATENT_FIELD_NUMBER: _ClassVar[int]
    mode: TilingOptions.Mode
    tile_latent_size: int
    overlap_latent: int
    def __init__(self, mode: _Optional[_Union[TilingOptions.Mode, str]] = ..., tile_latent_size: _Optional[int] = ..., overlap_latent: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("latents", "output", "tiling", "skip_scaling")
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TILING_FIELD_NUMBER: _ClassVar[int]
    SKIP_SCALING_FIELD_NUMBER: _ClassVar[int]
    latents: _tensor_pb2.Tensor
    output: OutputFormat
    tiling: TilingOptions
    skip_scaling: bool
    def __init__(self, latents: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., output: _Optional[_Union[OutputFormat, str]] = ..., tiling: _Optional[_Union[TilingOptions, _Mapping]] = ..., skip_scaling: bool = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("png", "pixels", "tiles")
    PNG_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    TILES_FIELD_NUMBER: _ClassVar[int]
    png: _containers.RepeatedScalarFieldContainer[bytes]
    pixels: _tensor_pb2.Tensor
    tiles: int
    def __init__(self, png: _Optional[_Iterable[bytes]] = ..., pixels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tiles: _Optional[int] = ...) -> None: ...
