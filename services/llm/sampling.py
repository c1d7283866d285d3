"""Sampling parameters (vLLM names) and a batched sampler.

The order is vLLM's, and each step's semantics Hugging Face's logits processors, so
greedy and seeded runs can be checked against `generate`:

1. the structured-output mask (xgrammar's token bitmask: services/llm/structured.py);
2. `min_tokens` (EOS and stop tokens masked until that many tokens are out), `logit_bias` (added);
3. repetition penalty over prompt + output tokens (divide positive logits, multiply negative ones),
   then OpenAI's presence / frequency penalties over the output tokens
   (logit -= count * frequency + (count > 0) * presence);
4. greedy argmax, or temperature, top-k, top-p (keep the smallest set whose probability reaches
   top_p, at least one), min-p (drop tokens below min_p x the top probability) and a draw.

Seeded rows draw from their own generator, so a request's tokens do not depend
on what else is in the batch. Output-token counts live on the device and are
updated there, so penalties do not make the engine wait for a step's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modalmesh import pb
from modalmesh.attention.metadata import host_to_device  # never waits for the device: the engine runs ahead
from modalmesh.errors import InvalidArgument
from services.llm.limits import RequestLimits  # noqa: F401 - SamplingParams.from_proto checks them; re-exported

MAX_LOGPROBS = 20
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_PROMPT_LOGPROBS = 20  # alternatives per prompt token (vLLM's prompt_logprobs; its -1, the vocabulary, is not taken)
MAX_N = 16  # choices from one request: each is a sequence of its own in the engine
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
_FLOAT_IDS = 1 << 24  # token ids travel in the logprobs tensor as float32: exact below this


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `kind` is one of KINDS; `spec` is the schema / regex / grammar text,
    or the choices (a tuple) for "choice", "" for json_object."""

    kind: str
    spec: str | tuple[str, ...] = ""

    KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    min_p: float = 0.0
    min_tokens: int = 0
    top_logprobs: int = 0
    include_stop_str_in_output: bool = False
    n: int = 1
    structured: StructuredOutput | None = None
    # None: off. k >= 0: each prompt token's logprob given the tokens before it (and its rank), and the k most
    # likely tokens at that position (vLLM's prompt_logprobs; OpenAI completions' echo with logprobs).
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def counts_output(self) -> bool:
        """Whether the sampler keeps per-token counts of the output (presence / frequency penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

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
            presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else 0.0,
            frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else 0.0,
            logit_bias=tuple(sorted(msg.logit_bias.items())),
            min_p=msg.min_p if msg.HasField("min_p") else 0.0,
            min_tokens=msg.min_tokens,
            top_logprobs=msg.top_logprobs,
            include_stop_str_in_output=msg.include_stop_str_in_output,
            n=msg.n or 1,
            structured=_structured_from_proto(msg.structured) if msg.HasField("structured") else None,
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also NaN
                raise bad(f"{name} must be in [-2, 2], got {value}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        outside = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
        if outside:
            raise bad(f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})")
        wild = [t for t, b in self.logit_bias if not -100.0 <= b <= 100.0]
        if wild:
            raise bad(f"logit_bias values must be in [-100, 100] (token ids {wild[:5]})")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs needs logprobs > 0")
        if self.top_logprobs and vocab_size > _FLOAT_IDS:
            raise bad(f"top_logprobs: a vocabulary of {vocab_size} tokens is too large for it")
        if not 1 <= self.n <= MAX_N:
            raise bad(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
                raise bad(f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {self.prompt_logprobs}")
            if vocab_size > _FLOAT_IDS:
                raise bad(f"prompt_logprobs: a vocabulary of {vocab_size} tokens is too large for it")
        if self.structured is not None:
            if self.ignore_eos:  # the grammar ends on EOS: ignoring it would run past the grammar's end
                raise bad("ignore_eos cannot be combined with structured output")
            if self.structured.kind == "choice" and (not self.structured.spec or not all(self.structured.spec)):
                raise bad("structured.choice needs at least one non-empty choice")


def _structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("sampling.structured: set one of json_schema, json_object, regex, choice, grammar")
    if kind == "choice":
        return StructuredOutput("choice", tuple(msg.choice.choices))
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidArgument("sampling.structured.json_object must be true when set")
        return StructuredOutput("json_object")
    return StructuredOutput(kind, getattr(msg, kind))


@dataclass
class SamplerRow:
    """Per-request sampling state the engine keeps between steps."""

    params: SamplingParams
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = field(default=None, repr=False)  # token ids for the repetition penalty
    counts: torch.Tensor | None = field(default=None, repr=False)  # (V,) output-token counts, on the device
    bias: torch.Tensor | None = field(default=None, repr=False)  # (V,) logit_bias, dense
    min_tokens_mask: torch.Tensor | None = field(default=None, repr=False)  # ids barred before min_tokens
    matcher: object | None = field(default=None, repr=False)  # xgrammar.GrammarMatcher
    barred: torch.Tensor | None = field(default=None, repr=False)  # ids the grammar bars besides its mask
    generated: int = 0  # tokens this row has sampled (min_tokens)

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: list[int], device: torch.device, *, vocab_size: int = 0,
               eos_token_ids=(), grammar=None) -> SamplerRow:
        """`vocab_size` sizes the dense tensors (penalties, bias); `grammar` is a
        services.llm.structured.Grammar for structured output."""
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = host_to_device(prompt_ids, torch.long, device)
        row = cls(params, generator, seen)
        if params.counts_output or params.logit_bias:
            if vocab_size <= 0:
                raise ValueError("penalties and logit_bias need the vocabulary size")
        if params.counts_output:
            row.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.logit_bias:
            bias = torch.zeros(vocab_size, dtype=torch.float32)
            ids, values = zip(*params.logit_bias)
            bias[list(ids)] = torch.tensor(values, dtype=torch.float32)
            row.bias = bias.to(device)
        if params.min_tokens:
            barred = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            if barred:
                row.min_tokens_mask = host_to_device(sorted(barred), torch.long, device)
        if grammar is not None:
            import xgrammar

            # The engine's EOS ids are the grammar's stop tokens: a finished grammar allows only them.
            row.matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=sorted(eos_token_ids) or None)
            if grammar.barred_ids:
                row.barred = host_to_device(list(grammar.barred_ids), torch.long, device)
        return row

    @property
    def feeds_next(self) -> bool:
        """False when this row needs its last token on the host before it samples again (the repetition
        penalty's token list, the grammar's state): the engine then waits for each step's tokens."""
        return self.seen is None and self.matcher is None

    def observe(self, token: int) -> None:
        if self.seen is not None:
            self.seen = torch.cat((self.seen, host_to_device([token], torch.long, self.seen.device)))
        if self.matcher is not None and not self.matcher.is_terminated():
            # The mask allowed only tokens the grammar accepts; a refusal would be a bug in the mask.
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused token {token} its own mask allowed")


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


def _grammar_mask(processed: torch.Tensor, rows: list[SamplerRow]) -> None:
    """xgrammar's next-token bitmask of each grammar row, applied in place (other rows: all allowed)."""
    import xgrammar

    vocab = processed.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab)  # all allowed
    for i, row in enumerate(rows):
        if row.matcher is not None and not row.matcher.is_terminated():
            row.matcher.fill_next_token_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(processed, bitmask.to(processed.device), vocab_size=vocab)
    for i, row in enumerate(rows):
        if row.barred is not None:
            processed[i].index_fill_(0, row.barred, float("-inf"))


def process_logits(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """Steps 1-3 of the module docstring on float32 (B, V) logits: what greedy takes the argmax of."""
    processed = logits
    if any(row.matcher is not None or row.bias is not None or row.seen is not None or row.counts is not None
           or (row.min_tokens_mask is not None and row.generated < row.params.min_tokens) for row in rows):
        processed = logits.clone()
    if any(row.matcher is not None for row in rows):
        _grammar_mask(processed, rows)
    for i, row in enumerate(rows):
        p = row.params
        if row.min_tokens_mask is not None and row.generated < p.min_tokens:
            processed[i].index_fill_(0, row.min_tokens_mask, float("-inf"))
        if row.bias is not None:
            processed[i] += row.bias
        if row.seen is not None:
            processed[i] = _apply_repetition_penalty(processed[i], row.seen, p.repetition_penalty)
        if row.counts is not None:
            processed[i] -= row.counts * p.frequency_penalty + (row.counts > 0).float() * p.presence_penalty
    return processed


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the top one (HF's MinPLogitsWarper; ratios of
    probabilities are ratios of exp(logits), so this needs no softmax and ignores earlier masks)."""
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits < top + torch.log(min_p).unsqueeze(1), float("-inf"))


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of (B, V) logits. Returns (tokens (B,), logprobs).

    Logprobs are of the model's raw distribution (before penalties and temperature), as vLLM reports;
    they are computed only when some row asks for them (zeros otherwise). Without top_logprobs they are
    the chosen tokens' (B,); when some row asks for K alternatives they are (B, 1 + 2K): the chosen
    token's, then the K largest, then those K tokens' ids as float32 (exact below 2^24), so one copy
    brings a step's logprobs to the host.
    """
    logits = logits.float()
    processed = process_logits(logits, rows)
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
        if any(rows[i].params.min_p > 0 for i in sampled):
            min_p = host_to_device([rows[i].params.min_p for i in sampled], torch.float32, device)
            sub = _min_p(sub, min_p)
        probs = sub.softmax(dim=-1)
        # Exponential race == multinomial draw; per-row generators keep seeded rows independent.
        noise = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            noise[j].exponential_(generator=rows[i].generator)
        tokens[idx] = (probs / noise).argmax(dim=-1)
    for i, row in enumerate(rows):
        row.generated += 1
        if row.counts is not None:  # on the device: the engine need not wait for the token
            row.counts.index_add_(0, tokens[i:i + 1], torch.ones(1, device=row.counts.device))
    if not any(row.params.logprobs for row in rows):
        return tokens, torch.zeros_like(tokens, dtype=torch.float32)
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = max(row.params.top_logprobs for row in rows)
    if not k:
        return tokens, chosen
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return tokens, torch.cat((chosen.unsqueeze(1), top.values, top.indices.float()), dim=1)


def unpack_logprobs(value, top_logprobs: int) -> tuple[float, list[tuple[int, float]]]:
    """One row of `sample`'s logprobs, read back: (the chosen token's, its top alternatives (id, logprob),
    at most `top_logprobs` of them)."""
    if not isinstance(value, list):
        return value, []
    k = (len(value) - 1) // 2
    n = min(top_logprobs, k)
    return value[0], [(int(value[1 + k + j]), value[1 + j]) for j in range(n)]


def score_prompt(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Prompt logprobs of (R, V) logits, each row the position before `targets`' token (R,): (R, 2 + 2k)
    float32 — the target's logprob, its rank (how many tokens are at least as likely, itself included: vLLM's count; 1 = the most likely), the k
    largest logprobs, then their ids as float32 (exact below 2^24). The model's raw distribution, as `sample`'s.
    The caller bounds R: the rows' log-softmax is R x V floats."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    rank = (logprobs >= chosen).sum(dim=-1, keepdim=True).float()
    if not k:
        return torch.cat((chosen, rank), dim=1)
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return torch.cat((chosen, rank, top.values, top.indices.float()), dim=1)


def unpack_prompt_scores(row: list[float], k: int) -> tuple[float, int, list[tuple[int, float]]]:
    """One row of `score_prompt`, read back: (logprob, rank, the top alternatives (id, logprob), at most k)."""
    width = (len(row) - 2) // 2
    n = min(k, width)
    return row[0], int(row[1]), [(int(row[2 + width + j]), row[2 + j]) for j in range(n)]
