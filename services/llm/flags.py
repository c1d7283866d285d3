"""The LLM service's flags, declared without the model stack: `python -m services.llm --help` imports no torch.

LLMService.add_arguments is `add_arguments`; `LLMConfig.from_args` reads what they parse.
"""

from __future__ import annotations

import argparse

from modalmesh.flags import service_parser
from services.llm.limits import RequestLimits

NAME = "llm"
DESCRIPTION = "modalmesh LLM service: streaming multimodal generation."
MAX_MESSAGE_MB = 256  # requests carry precomputed embeddings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-model-len", type=int, default=None, help="prompt + output token limit")
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size (default: from memory)")
    parser.add_argument("--mem-fraction", type=float, default=0.9, help="share of free GPU memory for the pool")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences in the running batch")
    parser.add_argument("--max-batch-tokens", type=int, default=1024,
                        help="token budget of one step: prompt chunks share it with the decode rows (long-prompt "
                             "loads keep more throughput at 2,048-8,192)")
    parser.add_argument("--max-prefill-chunk", type=int, default=None, help="longest prompt chunk of one step")
    parser.add_argument("--max-queue", type=int, default=1024, help="waiting requests beyond this: RESOURCE_EXHAUSTED")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the engine process's GIL switch interval (default: Python's, 5 ms): how long its "
                             "engine thread may wait for the GIL after each torch call while the event loop runs")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="shard the model over this many GPUs (ranks 1.. run as child processes)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: every step eager (graphs need a graph-safe attention backend)")
    parser.add_argument("--max-graph-tokens", type=int, default=2048,
                        help="largest step with prompt tokens that replays a CUDA graph, within --max-batch-tokens "
                             "(0: every such step eager); a step whose tokens would re-read too much context per "
                             "token in a graph runs eagerly too")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="recompute every prompt: no KV pages shared by content between requests")
    parser.add_argument("--no-fused-kernels", action="store_true",
                        help="the decoder layers' unfused PyTorch path on CUDA too (no Triton kernels)")
    parser.add_argument("--no-gemv-kernels", action="store_true",
                        help="one-row weight products (batch-1 decode) through cuBLAS instead of the Triton GEMV "
                             "(the GEMV is the faster on an H200: bench/gemv.py)")
    parser.add_argument("--vision-encoder", default=None, metavar="TARGET",
                        help="vision encoder pool, e.g. dns:///vision_encoder:50051 or ipv4:127.0.0.1:50061,...")
    parser.add_argument("--audio-encoder", default=None, metavar="TARGET", help="audio encoder pool")
    parser.add_argument("--encoder-timeout", type=float, default=60.0,
                        help="seconds an Encode may take when the Generate call has no deadline")
    parser.add_argument("--allow-foreign-encoders", action="store_true",
                        help="accept embeddings from encoders of another checkpoint (width is still checked)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template to render chat requests with, in place of the checkpoint's")
    limits = RequestLimits()
    parser.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings,
                        help="stop strings one request may send")
    parser.add_argument("--max-stop-string-chars", type=int, default=limits.max_stop_string_chars,
                        help="characters of one stop string")
    parser.add_argument("--max-stop-token-ids", type=int, default=limits.max_stop_token_ids,
                        help="stop token ids one request may send")
    parser.add_argument("--max-items-per-request", type=int, default=limits.max_items,
                        help="images / audio clips one request may carry")
    parser.add_argument("--encoder-shared-memory", choices=("auto", "off"), default="auto",
                        help="auto: take embeddings from encoders on this host through /dev/shm (negotiated per "
                             "call, bytes otherwise); off: always message bytes")


def parser() -> argparse.ArgumentParser:
    built = service_parser(NAME, DESCRIPTION, max_message_mb=MAX_MESSAGE_MB)
    add_arguments(built)
    return built
