"""Sampling parameters (vLLM names) and a batched sampler.

Semantics follow Hugging Face's logits processors so greedy and seeded runs can
be checked against `generate`: repetition penalty over prompt + output tokens
(divide positive logits, multiply negative ones), then temperature, top-k,
top-p (keep the smallest set whose probability reaches top_p, at least one).
Seeded rows draw from their own generator, so a request's tokens do not depend
on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modalmesh import pb
from modalmesh.attention.metadata import host_to_device  # never waits for the device: the engine runs ahead
from modalmesh.errors import InvalidArgument
from services.llm.limits import RequestLimits  # noqa: F401 - SamplingParams.from_proto checks them; re-exported

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int = 0
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(cls, msg: pb.SamplingParams, *, default_max_tokens: int, vocab_size: int,
                   limits: RequestLimits | None = None) -> SamplingParams:
        p = cls(
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            top_k=msg.top_k if msg.top_k != 0 else -1,
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            max_tokens=msg.max_tokens or default_max_tokens,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            seed=msg.seed if msg.HasField("seed") else None,
            ignore_eos=msg.ignore_eos,
            logprobs=msg.logprobs,
            skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        )
        (limits or RequestLimits()).check(p)  # counts first: validate walks the lists
        p.validate(vocab_size)
        return p

    def validate(self, vocab_size: int) -> None:
        def bad(what: str) -> InvalidArgument:
            return InvalidArgument(f"sampling.{what}")

        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad(f"top_k must be -1 (off) or > 0, got {self.top_k}")
        if not (self.repetition_penalty > 0.0):
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 0:
            raise bad(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise bad("stop strings must be non-empty")
        out_of_range = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if out_of_range:
            raise bad(f"stop_token_ids {out_of_range} are outside the vocabulary [0, {vocab_size})")


@dataclass
class SamplerRow:
    """Per-request sampling state the engine keeps between steps."""

    params: SamplingParams
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = field(default=None, repr=False)  # token ids for the repetition penalty

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: list[int], device: torch.device) -> SamplerRow:
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = host_to_device(prompt_ids, torch.long, device)
        return cls(params, generator, seen)

    def observe(self, token: int) -> None:
        if self.seen is not None:
            self.seen = torch.cat((self.seen, host_to_device([token], torch.long, self.seen.device)))


def _apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    picked = logits.gather(0, seen)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits.scatter(0, seen, picked)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (B, V) logits outside each row's top-k and top-p sets (HF semantics)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    # Ascending order: the top-k are the last k entries; mask below the k-th largest.
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1)
    remove = cumulative <= (1 - top_p).unsqueeze(1)
    remove[:, -1] = False  # keep at least the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of (B, V) logits. Returns (tokens (B,), chosen-token logprobs (B,)).

    Logprobs are of the model's raw distribution (before penalties and temperature), as vLLM reports;
    they are computed only when some row asks for them (zeros otherwise).
    """
    logits = logits.float()
    processed = logits
    if any(row.seen is not None for row in rows):
        processed = logits.clone()
        for i, row in enumerate(rows):
            if row.seen is not None:
                processed[i] = _apply_repetition_penalty(processed[i], row.seen, row.params.repetition_penalty)
    tokens = processed.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        device = logits.device
        idx = host_to_device(sampled, torch.long, device)
        sub = processed[idx]
        temperature = host_to_device([rows[i].params.temperature for i in sampled], torch.float32, device)
        sub = sub / temperature.unsqueeze(1)
        if any(rows[i].params.top_k > 0 or rows[i].params.top_p < 1 for i in sampled):
            top_k = host_to_device([rows[i].params.top_k for i in sampled], torch.long, device)
            top_p = host_to_device([rows[i].params.top_p for i in sampled], torch.float32, device)
            sub = _top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        # Exponential race == multinomial draw; per-row generators keep seeded rows independent.
        noise = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            noise[j].exponential_(generator=rows[i].generator)
        tokens[idx] = (probs / noise).argmax(dim=-1)
    if not any(row.params.logprobs for row in rows):
        return tokens, torch.zeros_like(tokens, dtype=torch.float32)
    chosen = logits.log_softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, chosen
