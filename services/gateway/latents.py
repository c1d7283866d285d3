"""Latents uploads (.npy, .safetensors, or raw bytes with dtype + shape) -> pb.Tensor, without torch.

* ``.npy``: float16 / float32 / float64 (sent as float32), any byte order.
* ``.safetensors``: the tensor named ``latents``, or the file's only tensor;
  F16 / BF16 / F32 pass through byte for byte, F64 is sent as float32.
* raw: little-endian C-order bytes with ``dtype`` (float32, float16, bfloat16) and ``shape``.

(C, h, w) gains a batch dimension. The VAE checks channels, sizes and values.
`decode_request` turns the upload's options (response_format, skip_scaling, tiling,
tile_latent_size, overlap_latent) into the DecodeRequest, each bad one a 400 naming it.
"""

from __future__ import annotations

import io
import json
import math
import struct

import numpy as np

from modalmesh import pb
from modalmesh.flags import FALSE_WORDS, TRUE_WORDS
from services.gateway.errors import bad_request
from services.gateway.protocol import INT32_MAX

NPY_MAGIC = b"\x93NUMPY"
_TILING = {"auto": pb.TilingOptions.AUTO, "on": pb.TilingOptions.ON, "off": pb.TilingOptions.OFF}
_NP_WIRE = {np.dtype("<f4"): pb.FLOAT32, np.dtype("<f2"): pb.FLOAT16}
_ST_WIRE = {"F32": (pb.FLOAT32, 4), "F16": (pb.FLOAT16, 2), "BF16": (pb.BFLOAT16, 2)}
_RAW_WIRE = {"float32": (pb.FLOAT32, 4), "float16": (pb.FLOAT16, 2), "bfloat16": (pb.BFLOAT16, 2)}


def _tensor(dtype: int, shape: list[int], data: bytes, param: str) -> pb.Tensor:
    shape = [int(d) for d in shape]
    if len(shape) == 3:
        shape = [1, *shape]
    if len(shape) != 4 or any(d <= 0 for d in shape):
        raise bad_request(f"latents must be (B, C, h, w) or (C, h, w) with positive sizes, got shape {shape}", param)
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def from_npy(data: bytes, param: str = "latents") -> pb.Tensor:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - ValueError, EOFError, ...: all "not a readable .npy"
        raise bad_request(f"latents: cannot read the .npy data ({type(exc).__name__})", param) from None
    if array.dtype.kind != "f" or array.dtype.itemsize not in (2, 4, 8):
        raise bad_request(f"latents: dtype {array.dtype} is not float16, float32 or float64", param)
    if array.dtype.itemsize == 8:
        array = array.astype("<f4")
    array = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False))
    return _tensor(_NP_WIRE[array.dtype], list(array.shape), array.tobytes(), param)


def from_safetensors(data: bytes, param: str = "latents") -> pb.Tensor:
    if len(data) < 8:
        raise bad_request("latents: not a .safetensors file (too short)", param)
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise bad_request("latents: not a .safetensors file (header size beyond the data)", param)
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        raise bad_request("latents: not a .safetensors file (unreadable header)", param) from None
    if not isinstance(header, dict):
        raise bad_request("latents: not a .safetensors file (header is not an object)", param)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if "latents" in tensors:
        name = "latents"
    elif len(tensors) == 1:
        name = next(iter(tensors))
    else:
        raise bad_request(f"latents: the file holds {sorted(tensors)[:8]}; name the tensor 'latents'", param)
    spec = tensors[name]
    try:
        dtype, shape, (begin, end) = spec["dtype"], list(spec["shape"]), spec["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise bad_request(f"latents: tensor {name!r} has a malformed header entry", param) from None
    body = data[8 + n:]
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= len(body)):
        raise bad_request(f"latents: tensor {name!r} lies outside the file", param)
    raw = body[begin:end]
    if dtype == "F64":
        if len(raw) != math.prod(shape) * 8:
            raise bad_request(f"latents: tensor {name!r} has {len(raw)} bytes for shape {shape}", param)
        return _tensor(pb.FLOAT32, shape, np.frombuffer(raw, "<f8").astype("<f4").tobytes(), param)
    if dtype not in _ST_WIRE:
        raise bad_request(f"latents: dtype {dtype} is not F16, BF16, F32 or F64", param)
    wire, size = _ST_WIRE[dtype]
    if len(raw) != math.prod(shape) * size:
        raise bad_request(f"latents: tensor {name!r} has {len(raw)} bytes for shape {shape} {dtype}", param)
    return _tensor(wire, shape, raw, param)


def from_file(data: bytes, param: str = "latents") -> pb.Tensor:
    """A .npy or .safetensors file's bytes, told apart by their first bytes."""
    if data.startswith(NPY_MAGIC):
        return from_npy(data, param)
    if len(data) >= 9 and data[8:9] == b"{":
        return from_safetensors(data, param)
    raise bad_request("latents: expected a .npy or .safetensors file (or raw bytes with dtype and shape)", param)


def from_raw(data: bytes, dtype: str, shape, param: str = "latents") -> pb.Tensor:
    if dtype not in _RAW_WIRE:
        raise bad_request(f"dtype must be one of {', '.join(_RAW_WIRE)}", "dtype")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise bad_request("shape must be a list of integers", "shape")
    wire, size = _RAW_WIRE[dtype]
    if any(d <= 0 for d in shape) or len(data) != math.prod(shape) * size:
        raise bad_request(f"latents: {len(data)} bytes do not make shape {shape} of {dtype}", param)
    return _tensor(wire, shape, data, param)


def decode_request(tensor: pb.Tensor, options: dict) -> tuple[pb.DecodeRequest, str]:
    """The DecodeRequest for `tensor` with the upload's options, and the response format (b64_json / png)."""
    decode = pb.DecodeRequest(latents=tensor, output=pb.PNG)
    fmt = str(options.get("response_format", "b64_json"))
    if fmt not in ("b64_json", "png"):
        raise bad_request("response_format must be b64_json or png", "response_format")
    if fmt == "png" and tensor.shape[0] != 1:
        raise bad_request(f"response_format png returns one image; these latents hold {tensor.shape[0]} "
                          "(use b64_json)", "response_format")
    if "skip_scaling" in options:
        decode.skip_scaling = _flag(options["skip_scaling"], "skip_scaling")
    tiling = str(options.get("tiling", "auto")).lower()
    if tiling not in _TILING:
        raise bad_request("tiling must be auto, on or off", "tiling")
    decode.tiling.mode = _TILING[tiling]
    for key in ("tile_latent_size", "overlap_latent"):
        if key in options:
            try:
                value = int(options[key])
            except (TypeError, ValueError):
                raise bad_request(f"{key} must be an integer", key) from None
            if not 0 <= value <= INT32_MAX:
                raise bad_request(f"{key} must be in [0, {INT32_MAX}]", key)
            setattr(decode.tiling, key, value)
    return decode, fmt


def _flag(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in TRUE_WORDS | FALSE_WORDS:
        raise bad_request(f"{name} must be true or false", name)
    return text in TRUE_WORDS
