"""One request inside the engine: what it asked for, what it has been sent, and how to reach it.

The scheduler's `Sequence` carries a `RequestState` (``Sequence[RequestState]``);
the runner reads the prompt (token ids, spliced embeddings, M-RoPE positions)
and the sampler row from it, the engine the detokeniser and the emitter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.llm.detokenizer import IncrementalDetokenizer
from services.llm.inputs import PreparedPrompt
from services.llm.sampling import SamplerRow, SamplingParams


@dataclass
class Delta:
    """What one request gets from one step (or at its end)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, found in the prefix cache (on the last delta)
    # On a request's first delta, when it asked for prompt logprobs: the prompt's token ids, and for each token
    # after the first, (its logprob, its rank, its top alternatives [(id, logprob)]).
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    error: BaseException | None = None
    # On a request's first token only: when (time.perf_counter, one clock for the service's processes) it
    # reached the engine and was first in a step, so the service can split its queue time from its prefill
    # in a trace (the engine thread does not emit then).
    arrival: float | None = None
    scheduled_at: float | None = None


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    prompt: PreparedPrompt
    sampler: SamplerRow
    detokenizer: IncrementalDetokenizer
    emit: Callable[[Delta], None]
    arrival: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    scheduled_at: float | None = None  # first time in a step (queue time ends, prefill begins)
    first_token_at: float | None = None
    finished: bool = False  # its request metrics observed (once, whichever way it ended)
    # Prompt logprobs, when asked: the row scoring prompt token p + 1 at index p, filled as prompt chunks run
    # (a preempted sequence's recomputed rows overwrite theirs alike); handed out with the first token.
    prompt_scores: list | None = None
