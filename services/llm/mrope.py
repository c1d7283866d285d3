"""3-D M-RoPE positions (Qwen2-VL / Qwen2.5-VL) for a prompt with image and video placeholders.

Text tokens advance one position on all three axes. An image's or a video's placeholder run
(``t * h/merge * w/merge`` tokens) takes (temporal, height, width) grid positions offset by
the position where it starts; text after it resumes at start + max(h, w) / merge. A video's
temporal grid steps are one position apart (Qwen2-VL), or ``time_interval`` apart, truncated
(Qwen2.5-VL: tokens_per_second x the seconds one step spans, in float32), as transformers'
``get_rope_index`` / ``get_vision_position_ids`` compute them. Generated tokens continue at
``index + delta`` on every axis, delta = (max prompt position + 1) - prompt length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from modalmesh.errors import InvalidArgument


class VisionSpan(NamedTuple):
    start: int  # the first placeholder's index in the prompt
    grid_thw: Sequence[int]
    time_interval: float | None = None  # temporal position step (a float32 value); None: 1, unscaled


def vision_positions(start: int, grid_thw: Sequence[int], spatial_merge: int,
                     time_interval: float | None = None) -> torch.Tensor:
    t, h, w = grid_thw[0], grid_thw[1] // spatial_merge, grid_thw[2] // spatial_merge
    temporal = torch.arange(t)
    if time_interval is not None:  # HF: (arange(t) * interval).long(), the product in float32
        temporal = (temporal * torch.tensor(time_interval, dtype=torch.float32)).long()
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(
    num_tokens: int,
    spans: Sequence[VisionSpan | tuple],
    spatial_merge: int,
) -> tuple[torch.Tensor, int]:
    """Positions (3, num_tokens) and the decode delta.

    spans: (first placeholder index, grid_thw[, time_interval]) of each image or video, in prompt
    order; one covers t*(h/merge)*(w/merge) consecutive tokens. Audio and text tokens take ordinary
    1-D positions (all three axes equal).
    """
    pieces: list[torch.Tensor] = []
    cursor = 0  # token index
    pos = 0  # next text position
    for span in spans:
        start, grid, interval = VisionSpan(*span)
        length = grid[0] * (grid[1] // spatial_merge) * (grid[2] // spatial_merge)
        if start < cursor or start + length > num_tokens:
            raise InvalidArgument(f"image placeholders at [{start}, {start + length}) overlap or exceed the prompt")
        if start > cursor:
            pieces.append(torch.arange(start - cursor).expand(3, -1) + pos)
            pos += start - cursor
        pieces.append(vision_positions(pos, grid, spatial_merge, interval))
        pos += max(grid[1], grid[2]) // spatial_merge
        cursor = start + length
    if cursor < num_tokens:
        pieces.append(torch.arange(num_tokens - cursor).expand(3, -1) + pos)
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = (int(positions.max()) + 1 - num_tokens) if num_tokens else 0
    return positions, delta
