"""Read tensors out of a Hugging Face / diffusers checkpoint directory, lazily.

    reader = CheckpointReader("/models/Qwen2-VL-7B", prefixes=("visual.",))
    for name, tensor in reader:          # only shards holding visual.* are opened
        ...
    reader.opened_files                  # which files were touched (tests assert on it)

Layouts, in order of preference: a safetensors index (``*.safetensors.index.json``,
sharded), safetensors files (``model.safetensors``,
``diffusion_pytorch_model.safetensors``, or every ``*.safetensors``), and as a
last resort PyTorch pickles (``*.bin``/``*.pt``) through
``torch.load(weights_only=True)``, which cannot run code. Diffusers pipelines
keep each component in a subfolder: ``CheckpointReader(dir, subfolder="vae")``.

Safetensors headers are parsed and checked here, before any tensor is read, so
a truncated download, an unknown dtype or an index that points at a missing
shard fails with the file and tensor named instead of deep inside a kernel.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from modalmesh.weights.errors import CheckpointError, nearest

# The safetensors dtype strings torch can hold (safetensors.torch's own table).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}

_BASENAMES = ("model", "diffusion_pytorch_model")  # HF transformers, diffusers
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
# Pickles that trainers leave next to the weights; they are not weights.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # start of the data within the file's data section (read order)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header without reading tensor data."""
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(_MAX_HEADER, size - 8):
            raise CheckpointError(
                f"{path}: header claims {header_len} bytes but the file has {size}: corrupt or truncated"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e}): corrupt file") from None
    data_size = size - 8 - header_len
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}") from None
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {dtype_name!r}, which this build cannot read "
                f"(readable: {', '.join(SAFETENSORS_DTYPES)})"
            )
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if end - start != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype_name}{list(shape)}) needs {nbytes} bytes "
                f"but its offsets span {end - start}: corrupt header"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {end} of the data section but the file holds "
                f"{data_size}: the file is truncated (incomplete download?)"
            )
        infos[name] = TensorInfo(name, path, dtype, shape, nbytes, start)
    return infos


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        # Legacy (non-zip) pickles cannot be memory-mapped.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot load as a PyTorch checkpoint: {e}") from None
    except Exception as e:  # UnpicklingError for code in the pickle, EOFError for truncation
        raise CheckpointError(f"{path}: cannot load as a PyTorch checkpoint: {e}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a flat name -> tensor state dict")
    return state


class CheckpointReader:
    """The tensors of one checkpoint directory, optionally restricted to name prefixes."""

    def __init__(
        self,
        path: str | Path,
        *,
        subfolder: str | None = None,
        prefixes: Iterable[str] | None = None,
        variant: str | None = None,
    ):
        root = Path(path).expanduser()
        if subfolder:
            root = root / subfolder
        if not root.is_dir():
            raise CheckpointError(f"{root}: no such checkpoint directory")
        self.root = root
        self.variant = variant
        self.prefixes = tuple(prefixes) if prefixes is not None else None
        self.opened_files: list[Path] = []  # every file whose bytes were read, in order
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._pickles: dict[Path, dict[str, torch.Tensor]] = {}
        self._wanted_map: dict[str, Path] | None = None
        self.format, self.index_file, self._weight_map = self._discover()

    # ---- discovery -------------------------------------------------------------------
    def _named(self, stem: str, suffix: str) -> str:
        return f"{stem}.{self.variant}{suffix}" if self.variant else f"{stem}{suffix}"

    def _discover(self) -> tuple[str, Path | None, dict[str, Path] | None]:
        """(format, index file or None, name -> file from the index, or None if files must be opened)."""
        for suffix, fmt in ((".safetensors", "safetensors"), (".bin", "pickle")):
            indexes = [self.root / self._named(b, suffix + ".index.json") for b in _BASENAMES]
            indexes = [p for p in indexes if p.is_file()] or sorted(self.root.glob(f"*{suffix}.index.json"))
            if self.variant:
                indexes = [p for p in indexes if f".{self.variant}." in p.name]
            if indexes:
                return fmt, indexes[0], self._read_index(indexes[0])
            singles = [self.root / self._named(b, suffix) for b in _BASENAMES]
            singles = [p for p in singles if p.is_file()]
            if not singles:
                singles = sorted(self.root.glob(f"*{suffix}"))
                if self.variant:
                    singles = [p for p in singles if f".{self.variant}." in p.name]
                if fmt == "pickle":
                    singles += [p for s in _PICKLE_SUFFIXES[1:] for p in sorted(self.root.glob(f"*{s}"))]
                    singles = [p for p in singles if not p.name.startswith(_NOT_WEIGHTS)]
            if singles:
                self._files = singles
                return fmt, None, None
        present = sorted(p.name for p in self.root.iterdir())[:20]
        raise CheckpointError(
            f"{self.root}: no weights found (looked for *.safetensors[.index.json], *.bin[.index.json]"
            f"{f' with variant {self.variant!r}' if self.variant else ''}); the directory holds {present}"
        )

    def _read_index(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid weight index ({e!r})") from None
        shards = {name: self.root / shard for name, shard in weight_map.items()}
        self._files = sorted(set(shards.values()))
        return shards

    # ---- which tensors, where --------------------------------------------------------
    def wanted(self, name: str) -> bool:
        return self.prefixes is None or name.startswith(self.prefixes)

    def _touch(self, path: Path) -> None:
        if path not in self.opened_files:
            self.opened_files.append(path)

    def _header(self, path: Path) -> dict[str, TensorInfo]:
        if path not in self._headers:
            if not path.is_file():
                raise CheckpointError(
                    f"{self.index_file}: lists tensors in shard {path.name}, which does not exist in {self.root}"
                )
            self._touch(path)
            self._headers[path] = read_safetensors_header(path)
        return self._headers[path]

    def _pickle(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._pickles:
            if not path.is_file():
                raise CheckpointError(f"{self.index_file}: lists shard {path.name}, which does not exist")
            self._touch(path)
            self._pickles[path] = _load_pickle(path)
        return self._pickles[path]

    def _file_keys(self, path: Path) -> Iterable[str]:
        return self._header(path) if self.format == "safetensors" else self._pickle(path)

    def weight_map(self) -> dict[str, Path]:
        """Wanted tensor name -> file. With an index, no shard is opened to answer this."""
        if self._wanted_map is None:
            self._wanted_map = self._build_weight_map()
        return self._wanted_map

    def _build_weight_map(self) -> dict[str, Path]:
        if self._weight_map is not None:
            return {n: p for n, p in self._weight_map.items() if self.wanted(n)}
        found: dict[str, Path] = {}
        for path in self._files:
            for name in self._file_keys(path):
                if self.wanted(name):
                    if name in found:
                        raise CheckpointError(f"{self.root}: tensor {name!r} is in both {found[name].name} and {path.name}")
                    found[name] = path
        return found

    def keys(self) -> list[str]:
        return sorted(self.weight_map())

    def __len__(self) -> int:
        return len(self.weight_map())

    def files(self) -> list[Path]:
        """The files that hold wanted tensors (all that iteration will open)."""
        return sorted(set(self.weight_map().values()))

    def infos(self) -> dict[str, TensorInfo]:
        """Name -> dtype/shape/bytes of every wanted tensor (reads only headers)."""
        out = {}
        for name, path in self.weight_map().items():
            if self.format == "safetensors":
                out[name] = self._info_in(path, name)
            else:
                t = self._pickle(path)[name]
                out[name] = TensorInfo(name, path, t.dtype, tuple(t.shape), t.nbytes, 0)
        return out

    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.infos().values())

    def _info_in(self, path: Path, name: str) -> TensorInfo:
        info = self._header(path).get(name)
        if info is None:
            raise CheckpointError(f"{self.index_file}: maps {name!r} to shard {path.name}, but that shard has no such tensor")
        return info

    # ---- reading ---------------------------------------------------------------------
    def get_tensor(self, name: str) -> torch.Tensor:
        path = self.weight_map().get(name)
        if path is None:
            close = nearest(name, self.weight_map())
            raise CheckpointError(
                f"{self.root}: no tensor {name!r} in the checkpoint"
                + (f" (nearest: {', '.join(close)})" if close else "")
            )
        if self.format == "pickle":
            return self._pickle(path)[name]
        self._info_in(path, name)
        with self._safe_open(path) as f:
            return self._read(f, path, name)

    __getitem__ = get_tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, like a state dict's items(); dict(reader) also works."""
        return self.iter_tensors()

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every wanted tensor, file by file, in on-disk order."""
        by_file: dict[Path, list[str]] = {}
        for name, path in self.weight_map().items():
            by_file.setdefault(path, []).append(name)
        for path in sorted(by_file):
            names = by_file[path]
            if self.format == "pickle":
                state = self._pickle(path)
                for name in sorted(names):
                    yield name, state[name]
                continue
            names.sort(key=lambda n: self._info_in(path, n).offset)  # sequential reads
            with self._safe_open(path) as f:
                for name in names:
                    yield name, self._read(f, path, name)

    def _safe_open(self, path: Path):
        self._touch(path)
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot open as safetensors: {e}") from None

    @staticmethod
    def _read(f, path: Path, name: str) -> torch.Tensor:
        try:
            return f.get_tensor(name)
        except (SafetensorError, OSError, TypeError, KeyError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from None
