"""What one request may ask of the LLM engine: the limits behind --max-stop-strings and friends.

Plain data (no torch), so the flags that set them (services/llm/flags.py) stay cheap to declare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from modalmesh.errors import InvalidArgument

if TYPE_CHECKING:
    from services.llm.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the engine (each a flag of the LLM service): past these, one request
    could slow every other request on the engine thread or hold memory out of proportion."""

    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 256
    max_items: int = 64  # images / audio clips in one request

    def check(self, params: SamplingParams) -> None:
        def over(what: str, n: int, limit: int, flag: str) -> InvalidArgument:
            return InvalidArgument(f"sampling.{what}: {n} exceeds this server's limit of {limit} ({flag})")

        if len(params.stop) > self.max_stop_strings:
            raise over("stop", len(params.stop), self.max_stop_strings, "--max-stop-strings")
        longest = max((len(s) for s in params.stop), default=0)
        if longest > self.max_stop_string_chars:
            raise over("stop", longest, self.max_stop_string_chars, "--max-stop-string-chars; characters of one "
                                                                    "stop string")
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise over("stop_token_ids", len(params.stop_token_ids), self.max_stop_token_ids,
                       "--max-stop-token-ids")

    def check_items(self, n: int) -> None:
        if n > self.max_items:
            raise InvalidArgument(f"items: {n} images / audio clips exceed this server's limit of {self.max_items} "
                                  "per request (--max-items-per-request)")
