"""The LLM service's configuration: one frozen value, built once from the flags, handed whole to every rank.

    config = LLMConfig.from_args(args, device=torch.device("cuda"), dtype=torch.bfloat16)
    worker = dataclasses.replace(config, rank=1)     # what rank 1 runs with (nano-vllm, mini-sglang)

Nothing below the service's entry point reads `args` or the environment: the
engine, the runner, the model, the KV pool and the attention selector all take
their settings from this value. Start-up checks that need the checkpoint's
config (the context length) happen here, so a bad flag fails before any rank
is spawned.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch

from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from modalmesh.interpreter import switch_interval_s
from modalmesh.rpc.security import INSECURE, Security
from services.llm.limits import RequestLimits

CPU_DEFAULT_KV_TOKENS = 32768  # a CPU pool sized from free RAM would be absurd


@dataclass(frozen=True)
class EncoderTargets:
    """Where the LLM sends raw media, and how it takes the answers."""

    vision: str | None = None
    audio: str | None = None
    timeout_s: float = 60.0
    allow_foreign: bool = False
    shared_memory: bool = True  # take embeddings through /dev/shm from encoders on this host
    max_message_bytes: int = 256 << 20  # largest Encode answer taken
    security: Security = INSECURE  # TLS to the encoders and the shared token


@dataclass(frozen=True)
class LLMConfig:
    model_dir: Path
    device_type: str = "cpu"  # "cpu" | "cuda"; rank r of a CUDA group runs on cuda:r
    dtype: torch.dtype = torch.float32
    dummy_weights: bool = False
    attention_backend: str = ""  # --attention-backend, e.g. "llm=sdpa_math"; "": automatic
    # KV pool and batching
    max_model_len: int = 4096
    page_size: int = 16
    kv_cache_tokens: int | None = None  # None: sized from free device memory
    mem_fraction: float = 0.9
    max_num_seqs: int = 256
    # Prompt tokens of a step beside its decode rows fill the compute that the rows' weight reads leave idle
    # (Sarathi-Serve). 1,024 over 8,192 on an H100 (docs/architecture.md, budget2-17): image+text +11 %, 256 text
    # streams +5 %; 16 streams of 4k-token prompts -3..-13 % and TPOT +20-40 %, a lone one's TTFT unchanged.
    max_batch_tokens: int = 1024
    max_prefill_chunk: int | None = None
    max_queue: int = 1024
    cuda_graphs: bool = True
    # Mixed steps up to this many tokens replay a CUDA graph (0: none); longer ones run eagerly. 2,048 over 1,024:
    # image+text 76.8 against 71.1 req/s on an H100 (docs/architecture.md, graphs-17).
    max_graph_tokens: int = 2048
    fused_kernels: bool = True  # the decoder layers' Triton kernels on CUDA (modalmesh.kernels)
    gemv_kernels: bool = True  # one-row products (batch-1 decode) through modalmesh.kernels.gemv, with the fused
    # kernels (--no-gemv-kernels: cuBLAS)
    # tensor parallelism
    tensor_parallel_size: int = 1
    rank: int = 0
    dist_port: int = 0  # rendezvous port of the rank group on 127.0.0.1 (rank 0 picks it before spawning)
    encoders: EncoderTargets = EncoderTargets()
    limits: RequestLimits = RequestLimits()
    chat_template: str | None = None  # --chat-template's text; None: the checkpoint's own
    log_level: str = "INFO"
    log_format: str = "text"  # --log-format, for the rank processes too (modalmesh.logs)
    gc_freeze: bool = True  # --no-gc-freeze turns it off; the ranks >= 1 freeze their heaps too (modalmesh.heap)
    prefix_caching: bool = True  # --no-prefix-caching turns it off (services/llm/scheduler.py)
    # The engine process's GIL switch interval (--switch-interval-ms; None: Python's 5 ms). Its engine thread
    # releases the GIL at every torch call and waits up to this long to get it back from the event loop.
    switch_interval_s: float | None = None

    def __post_init__(self):
        if self.device_type not in ("cpu", "cuda"):
            raise ConfigError(f"device {self.device_type!r}: expected cpu or cuda")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size}: must be >= 1")
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ConfigError(f"rank {self.rank} outside a group of {self.tensor_parallel_size}")
        for name in ("max_model_len", "page_size", "max_num_seqs", "max_batch_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        for name, value in vars(self.limits).items():
            if value < 0:
                flag = "--max-items-per-request" if name == "max_items" else "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} {value}: must be >= 0")
        if self.max_batch_tokens < self.max_num_seqs:  # vLLM refuses the same: slots no step could decode
            raise ConfigError(f"--max-batch-tokens {self.max_batch_tokens} is below --max-num-seqs {self.max_num_seqs}: "
                              "a step could not give every running sequence its decode token; raise the budget "
                              "or lower the sequences")
        if self.max_graph_tokens < 0:
            raise ConfigError(f"--max-graph-tokens {self.max_graph_tokens}: must be >= 0")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ConfigError(f"--kv-cache-tokens {self.kv_cache_tokens}: must be >= 1")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ConfigError(f"--mem-fraction {self.mem_fraction}: must be in (0, 1]")

    @property
    def device(self) -> torch.device:
        """This rank's device: one GPU per rank, in rank order."""
        return torch.device("cuda", self.rank) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_dir: Path, *, device: torch.device,
                  dtype: torch.dtype, security: Security = INSECURE) -> LLMConfig:
        """The service's flags (MODALMESH_* already folded in by the parser), checked against the checkpoint."""
        tp = args.tensor_parallel_size
        if device.type == "cuda" and tp > torch.cuda.device_count():
            raise ConfigError(f"--tensor-parallel-size {tp}: needs 1..{torch.cuda.device_count()} visible GPUs")
        cfg = ModelConfig.from_hf(model_dir)
        max_model_len = args.max_model_len or cfg.max_position_embeddings or 0
        if not max_model_len:
            raise ConfigError("the config has no max_position_embeddings: pass --max-model-len")
        kv_tokens = args.kv_cache_tokens
        if kv_tokens is None and device.type == "cpu":
            kv_tokens = max(CPU_DEFAULT_KV_TOKENS, max_model_len)
        return cls(
            model_dir=Path(model_dir), device_type=device.type, dtype=dtype, dummy_weights=args.dummy_weights,
            attention_backend=args.attention_backend or "", max_model_len=max_model_len, page_size=args.page_size,
            kv_cache_tokens=kv_tokens, mem_fraction=args.mem_fraction, max_num_seqs=args.max_num_seqs,
            max_batch_tokens=args.max_batch_tokens, max_prefill_chunk=args.max_prefill_chunk,
            max_queue=args.max_queue, cuda_graphs=not args.enforce_eager,
            max_graph_tokens=args.max_graph_tokens,
            fused_kernels=not args.no_fused_kernels, gemv_kernels=not getattr(args, "no_gemv_kernels", False),
            tensor_parallel_size=tp,
            encoders=EncoderTargets(vision=args.vision_encoder, audio=args.audio_encoder,
                                    timeout_s=args.encoder_timeout, allow_foreign=args.allow_foreign_encoders,
                                    shared_memory=args.encoder_shared_memory == "auto",
                                    max_message_bytes=args.max_message_mb << 20, security=security),
            limits=RequestLimits(max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
                                 max_stop_token_ids=args.max_stop_token_ids, max_items=args.max_items_per_request),
            log_level=args.log_level, log_format=getattr(args, "log_format", "text"),
            gc_freeze=getattr(args, "gc_freeze", True), prefix_caching=not getattr(args, "no_prefix_caching", False),
            chat_template=read_chat_template(getattr(args, "chat_template", None)),
            switch_interval_s=switch_interval_s(args.switch_interval_ms),
        )


def read_chat_template(path: str | None) -> str | None:
    """--chat-template FILE's text, its Jinja syntax checked at start-up (a typo is one line, exit 2, not an
    error on every chat request)."""
    if not path:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: cannot read it ({exc})") from None
    if not text.strip():
        raise ConfigError(f"--chat-template {path}: the file is empty")
    try:  # transformers renders with the loopcontrols extension; parse as it would
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template {path}: line {exc.lineno}: {exc.message}") from None
    return text
