"""Test videos and transformers' video rules, for the video tests (tests/test_video*.py).

    data = make_video(frames=12, fps=8)                       # an MP4 of synthetic colour patterns (PyAV)
    sample = hf_video_method("sample_frames")                 # transformers' own code, run without torchvision
    pixels, grid, seconds = hf_video_inputs(path, model_dir)  # what HF's video path is given for that file

transformers' Qwen2VLVideoProcessor imports torchvision at module level, which cannot be installed beside this
stack: its pure methods (``sample_frames``, ``patchify``) are compiled here from the installed source file
itself, so the references are transformers' code, not a transcription of it. Its resize (torchvision's) is the
one step that cannot run: each frame is resized by the PIL image processor instead (what the encoder does).
"""

from __future__ import annotations

import ast
import io
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def frame_pattern(i: int, height: int, width: int) -> np.ndarray:
    """Frame i of a synthetic video: colour bands that move and change with i (uint8, H x W x 3)."""
    y, x = np.mgrid[0:height, 0:width]
    frame = np.empty((height, width, 3), np.uint8)
    frame[..., 0] = (x * 4 + i * 23) % 256
    frame[..., 1] = (y * 5 + i * 41) % 256
    frame[..., 2] = np.where((x // 8 + y // 8 + i) % 2, 220, 30)
    return frame


def make_video(frames: int = 12, fps: int = 8, width: int = 64, height: int = 48, *, container: str = "mp4",
               codec: str = "mpeg4") -> bytes:
    """An encoded video of `frames` synthetic frames (mpeg4 in MP4 by default; libvpx in webm works too)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_pattern(i, height, width), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def hf_video_method(name: str):
    """`Qwen2VLVideoProcessor.<name>` compiled from transformers' installed source (no torchvision needed)."""
    import transformers.models.qwen2_vl as package

    path = Path(package.__file__).parent / "video_processing_qwen2_vl.py"
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "Qwen2VLVideoProcessor":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    item.decorator_list = []
                    item.returns = None
                    for arg in item.args.args + item.args.kwonlyargs:
                        arg.annotation = None  # VideoMetadata and others are not imported here
                    namespace = {"math": math, "torch": torch}
                    exec(compile(ast.Module(body=[item], type_ignores=[]), str(path), "exec"), namespace)
                    return namespace[name]
    raise LookupError(f"Qwen2VLVideoProcessor.{name} not found in transformers' source")


def hf_processor_defaults(**overrides) -> SimpleNamespace:
    """The `self` HF's sample_frames reads: the processor's class attributes (num_frames and fps unset)."""
    return SimpleNamespace(**{"num_frames": None, "fps": None, "temporal_patch_size": 2, "min_frames": 4,
                              "max_frames": 768, **overrides})


def hf_video_inputs(video_path: Path, model_dir: Path, *, fps: float, max_frames: int,
                    temporal_patch_size: int = 2) -> tuple[torch.Tensor, list[int], float]:
    """(pixel_values_videos, video_grid_thw, second_per_grid_t) of one video file as HF's video path would make
    them: transformers' read_video_pyav with Qwen2VLVideoProcessor.sample_frames (its own code) picks and decodes
    the frames; each frame goes through the checkpoint's PIL image processor (for torchvision's resize), and
    the frames' patches are laid out by Qwen2VLVideoProcessor.patchify (its own code); seconds per grid step is
    temporal_patch_size / VideoMetadata.sampled_fps, as Qwen2_5_VLProcessor computes it."""
    from transformers import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    from transformers.video_utils import read_video_pyav

    sample = hf_video_method("sample_frames")
    defaults = hf_processor_defaults(temporal_patch_size=temporal_patch_size)
    frames, metadata = read_video_pyav(str(video_path), lambda metadata, **kw: sample(
        defaults, metadata, fps=fps, max_frames=max_frames))
    proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    factor = proc.patch_size * proc.merge_size
    height, width = smart_resize(frames.shape[1], frames.shape[2], factor=factor, min_pixels=proc.size["shortest_edge"],
                                 max_pixels=proc.size["longest_edge"])
    from PIL import Image

    patchify = hf_video_method("patchify")
    processed = []
    for frame in frames:  # resized to the video's one size, then rescaled and normalised as an image
        image = Image.fromarray(frame).resize((width, height), resample=proc.resample)
        out = proc(images=[image], return_tensors="pt")
        assert out["image_grid_thw"][0].tolist() == [1, height // proc.patch_size, width // proc.patch_size]
        pixels = _unpatchify(out["pixel_values"], height, width, proc.patch_size, proc.merge_size)
        # The inverse is checked by HF's own layout: the frame repeated, patchified by the video processor, gives
        # the image processor's rows back.
        again = patchify(None, pixels[None, None].expand(1, temporal_patch_size, -1, -1, -1), proc.patch_size,
                         proc.merge_size, temporal_patch_size)[0][0]
        assert torch.equal(again, out["pixel_values"])
        processed.append(pixels)
    video = torch.stack(processed)[None]  # (1, T, C, H, W)
    rows, t, h, w = patchify(None, video, proc.patch_size, proc.merge_size, temporal_patch_size)
    seconds = temporal_patch_size / metadata.sampled_fps
    return rows[0], [t, h, w], seconds


def _unpatchify(rows: torch.Tensor, height: int, width: int, patch: int, merge: int) -> torch.Tensor:
    """An image processor's rows (one image, its frame repeated temporal_patch_size times) back to the
    (C, H, W) frame they were cut from (its first temporal copy)."""
    gh, gw = height // patch, width // patch
    channels = 3
    tps = rows.shape[1] // (channels * patch * patch)
    blocks = rows.reshape(gh // merge, gw // merge, merge, merge, channels, tps, patch, patch)[:, :, :, :, :, 0]
    # (gh/m, gw/m, mh, mw, C, ph, pw) -> (C, gh/m, mh, ph, gw/m, mw, pw)
    return blocks.permute(4, 0, 2, 5, 1, 3, 6).reshape(channels, height, width)
