"""Which accelerator this process runs on, as a small frozen value tests can fake.

Selection never asks the hardware directly: it is handed a `Platform`, so a test
can build ``Platform.cuda((10, 3))`` on a CPU box and check what a Blackwell
sm103 would get. `detect_platform()` is the only function that looks at torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

KINDS = ("cuda", "rocm", "cpu")


@dataclass(frozen=True)
class Platform:
    kind: str  # "cuda" | "rocm" | "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability; ROCm reports one too
    arch_name: str = ""  # ROCm gfx name without feature suffixes ("gfx950"); "" elsewhere
    device_name: str = ""  # marketing name, for logs only
    detected: bool = False  # True when read from real hardware (then selection may smoke-test kernels)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"platform kind {self.kind!r} is not one of {KINDS}")

    @classmethod
    def cpu(cls) -> Platform:
        return cls("cpu")

    @classmethod
    def cuda(cls, capability: tuple[int, int], device_name: str = "") -> Platform:
        return cls("cuda", tuple(capability), device_name=device_name)

    @classmethod
    def rocm(cls, arch_name: str, capability: tuple[int, int] | None = None, device_name: str = "") -> Platform:
        return cls("rocm", capability, arch_name=arch_name, device_name=device_name)

    @property
    def torch_device_type(self) -> str:
        # ROCm builds of torch expose the GPU as "cuda".
        return "cpu" if self.kind == "cpu" else "cuda"

    def describe(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        if self.kind == "rocm":
            text = f"rocm {self.arch_name or 'unknown arch'}"
        else:
            major, minor = self.capability or (0, 0)
            text = f"cuda sm{major}{minor}"
        return f"{text} ({self.device_name})" if self.device_name else text


@lru_cache(maxsize=None)
def _detect(device_type: str, index: int) -> Platform:
    if device_type == "cpu" or not torch.cuda.is_available():
        return Platform("cpu", detected=True)
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    if getattr(torch.version, "hip", None):
        # gcnArchName looks like "gfx950:sramecc+:xnack-"; selection only needs "gfx950".
        arch = getattr(props, "gcnArchName", "").split(":")[0]
        return Platform("rocm", capability, arch_name=arch, device_name=props.name, detected=True)
    return Platform("cuda", capability, device_name=props.name, detected=True)


def detect_platform(device: torch.device | str | None = None) -> Platform:
    """The platform of `device` (default: the current CUDA device if any, else CPU). Cached."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "meta":  # models are built on meta; they will run where CUDA is, if anywhere
        return detect_platform(None)
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _detect(device.type, index)
