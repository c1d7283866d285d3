"""The encoder services' configuration: one frozen value built once from the flags.

    config = EncoderServiceConfig.from_args(args, model_options={"max_image_pixels": ...})

The shared flags (batching, cache, request limits, preprocessing threads, shared
memory) and, as `model_options`, the tower's own settings that the vision / audio
subclass collects for its model builder. Nothing below the service reads `args`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from modalmesh.errors import ConfigError
from modalmesh.interpreter import switch_interval_s

MiB = 1 << 20


@dataclass(frozen=True)
class EncoderServiceConfig:
    max_batch_tokens: int = 16384  # batch budget in patches (vision) or mel frames (audio)
    max_batch_items: int = 64
    batch_window_s: float = 0.002  # how long a batch waits for concurrent requests to join
    batches_in_flight: int = 2  # queued on the device at once: one running, the next one ready behind it
    switch_interval_s: float | None = None  # the GIL's switch interval; None: Python's
    torch_threads: int | None = None  # torch's intra-op CPU threads; None: torch's own
    max_queue: int = 1024  # queued items beyond this: RESOURCE_EXHAUSTED
    max_items_per_request: int = 64
    cache_bytes: int = 256 * MiB  # embedding cache; 0 disables it
    preprocess_threads: int = 4
    shared_memory: bool = True  # answer same-host clients through /dev/shm
    shared_memory_bytes: int = 1024 * MiB
    shared_memory_ttl_s: float = 30.0
    dummy_weights: bool = False
    warmup: bool = True  # a warm-up forward before SERVING
    model_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_options: Mapping[str, Any] | None = None
                  ) -> EncoderServiceConfig:
        for flag, value in (("--batches-in-flight", args.batches_in_flight), ("--torch-threads", args.torch_threads)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be positive, not {value}")
        return cls(
            max_batch_tokens=args.max_batch_tokens, max_batch_items=args.max_batch_items,
            batch_window_s=args.batch_window_ms / 1e3, batches_in_flight=args.batches_in_flight,
            switch_interval_s=switch_interval_s(args.switch_interval_ms),
            torch_threads=args.torch_threads,
            max_queue=args.max_queue,
            max_items_per_request=args.max_items_per_request, cache_bytes=args.cache_mb * MiB,
            preprocess_threads=args.preprocess_threads, shared_memory=args.shared_memory_transfer == "auto",
            shared_memory_bytes=args.shared_memory_mb * MiB, shared_memory_ttl_s=args.shared_memory_ttl,
            dummy_weights=args.dummy_weights, warmup=args.warmup,
            model_options=MappingProxyType(dict(model_options or {})),
        )
