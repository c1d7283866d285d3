"""Video files -> the frames Qwen2-VL's video processor samples from them (PyAV decodes; HF's rules pick).

    video = read_video(data, "items[0]", sampling, temporal_patch_size=2, frame=lambda rgb: ...)
    video.frames, video.second_per_grid_t

What transformers does with a video file, step by step, with the exceptions said where they are:

1. the container: only MP4 / MOV, Matroska / WebM and AVI, recognised by their magic bytes and opened
   with that demuxer alone. FFmpeg's probing would also pick playlist and concat demuxers (HLS, ffconcat),
   which open the files and URLs a playlist names: a video is never allowed to reach anything else;
2. its metadata as ``transformers.video_utils.read_video_pyav`` reads it: ``total_num_frames`` the video
   stream's frame count, ``fps`` its average rate. Where the container does not state a count (WebM,
   Matroska) the stream's packets are counted instead (transformers would sample from 0 frames and fail);
3. the indices: ``Qwen2VLVideoProcessor.sample_frames`` (transformers 5.24,
   models/qwen2_vl/video_processing_qwen2_vl.py) with ``fps`` given: ``total / video_fps * fps`` frames,
   at least ``min_frames``, at most ``max_frames`` and the video's own frames (that cap first rounded down
   to a multiple of temporal_patch_size), rounded down to a multiple of temporal_patch_size, taken at
   ``arange(0, total, total / n).int()`` in torch's float32, as it computes them. A video of fewer frames
   than temporal_patch_size (which transformers divides by zero on) gives all its frames; the processor's
   patchify pads them by repetition;
4. the frames decoded in order, each at a sampled index converted with ``frame.to_ndarray(format="rgb24")``
   (read_video_pyav's call) and handed to `frame` at once, so only the sampled frames' processed forms are
   held, never the decoded video;
5. seconds per temporal grid step, which Qwen2.5-VL's positions scale by: ``temporal_patch_size /
   sampled_fps``, ``sampled_fps = len(indices) / total * fps`` (``VideoMetadata.sampled_fps`` and
   ``Qwen2_5_VLProcessor._process_videos``).

Limits come first, from the headers, before any frame is decoded: the duration (``--max-video-seconds``), the
frame rate (`MAX_SOURCE_FPS`: the decoding work is the video's frames up to the last sampled one) and each
frame's pixels (``--max-image-pixels``). Anything unusable is an `InvalidArgument` naming the item; PyAV
missing is one too, naming the extra that installs it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from modalmesh.errors import ConfigError, InvalidArgument

from services.vision_encoder.flags import (  # noqa: F401 - the flags' defaults, declared without torch
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_MAX_VIDEO_SECONDS,
    DEFAULT_VIDEO_FPS,
    MAX_SOURCE_FPS,
)

T = TypeVar("T")
DEFAULT_MIN_FRAMES = 4  # Qwen2VLVideoProcessor.min_frames (a video_preprocessor_config.json may say otherwise)
EXTRA = "modalmesh[video]"
# Container -> the one demuxer that opens it. The magic bytes decide, never FFmpeg's probe (see 1. above).
CONTAINERS = {"mov": "MP4 / MOV", "matroska": "Matroska / WebM", "avi": "AVI"}
MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot")


@dataclass(frozen=True)
class VideoSampling:
    """How frames are taken from a video, and what a video may cost. The vision encoder's flags."""

    fps: float = DEFAULT_VIDEO_FPS  # --video-fps
    min_frames: int = DEFAULT_MIN_FRAMES  # the video processor's (video_preprocessor_config.json)
    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES  # --max-video-frames
    max_seconds: float = DEFAULT_MAX_VIDEO_SECONDS  # --max-video-seconds

    def check(self, temporal_patch_size: int) -> None:
        if not 0 < self.fps <= MAX_SOURCE_FPS:
            raise ConfigError(f"--video-fps {self.fps:g} must be in (0, {MAX_SOURCE_FPS:g}]")
        if self.max_frames < temporal_patch_size:
            raise ConfigError(f"--max-video-frames {self.max_frames} is below one temporal patch "
                              f"({temporal_patch_size} frames)")
        if self.max_seconds <= 0:
            raise ConfigError(f"--max-video-seconds {self.max_seconds:g} must be > 0")

    def key(self) -> bytes:
        """What changes the frames taken (part of each video's embedding-cache key)."""
        return f"{self.fps!r}:{self.min_frames}:{self.max_frames}".encode()


@dataclass(frozen=True)
class SampledVideo(Generic[T]):
    frames: list[T]  # what `frame` made of each sampled frame, in order
    second_per_grid_t: float  # seconds one temporal grid step spans (Qwen2.5-VL's positions)
    total_frames: int  # the video's frames, as its header (or its packets) count them
    source_fps: float
    size: tuple[int, int]  # (height, width) of its frames


def available() -> bool:
    """Whether PyAV imports (the extra modalmesh[video])."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def container(data: bytes) -> str | None:
    """The demuxer for `data` by its magic bytes (a key of CONTAINERS), or None."""
    if len(data) >= 12 and data[4:8] in MP4_BOXES:
        return "mov"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def sample_indices(total_frames: int, video_fps: float, sampling: VideoSampling,
                   temporal_patch_size: int) -> list[int]:
    """Qwen2VLVideoProcessor.sample_frames with `fps` given (transformers 5.24), but for a video shorter than
    one temporal patch, which gives all its frames (transformers divides by zero there)."""
    max_frames = math.floor(min(sampling.max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
    num_frames = total_frames / video_fps * sampling.fps
    num_frames = min(max(num_frames, sampling.min_frames), max_frames, total_frames)
    num_frames = math.floor(num_frames / temporal_patch_size) * temporal_patch_size
    if num_frames == 0:
        return list(range(total_frames))
    return torch.arange(0, total_frames, total_frames / num_frames).int().tolist()


def second_per_grid_t(num_indices: int, total_frames: int, video_fps: float, temporal_patch_size: int) -> float:
    """temporal_patch_size / VideoMetadata.sampled_fps, as Qwen2_5_VLProcessor computes it."""
    sampled_fps = num_indices / total_frames * video_fps
    return temporal_patch_size / sampled_fps


def _import_av(where: str):
    try:
        import av
    except ImportError:
        raise InvalidArgument(f"{where}: this vision encoder cannot decode video: PyAV is not installed (install "
                              f"the extra {EXTRA}, i.e. pip install 'av>=12,<19')") from None
    return av


def _open(av, data: bytes, demuxer: str, where: str):
    try:
        return av.open(io.BytesIO(data), mode="r", format=demuxer)
    except (av.FFmpegError, ValueError, OSError, EOFError) as exc:
        raise InvalidArgument(f"{where}: corrupt or truncated {CONTAINERS[demuxer]} video "
                              f"({type(exc).__name__}: {exc})") from None


def read_video(data: bytes, where: str, sampling: VideoSampling, *, temporal_patch_size: int,
               max_frame_pixels: int, frame: Callable[[object], T],
               before_decoding: Callable[[int, int, int], AbstractContextManager] | None = None) -> SampledVideo[T]:
    """The sampled frames of the video file `data`, each as `frame(rgb)` made it from its (H, W, 3) uint8 array.
    `before_decoding(frames, height, width)`, when given, runs once the sampled frames' count and size are
    known, before any frame is decoded: a context manager held while decoding (the decode memory budget)."""
    if not data:
        raise InvalidArgument(f"{where}: empty video data")
    demuxer = container(data)
    if demuxer is None:
        raise InvalidArgument(f"{where}: data is not a video this server decodes ({', '.join(CONTAINERS.values())}; "
                              f"{len(data)} bytes starting {data[:12]!r})")
    av = _import_av(where)
    with _open(av, data, demuxer, where) as box:
        streams = box.streams.video
        if not streams:
            raise InvalidArgument(f"{where}: the {CONTAINERS[demuxer]} file has no video stream")
        stream = streams[0]
        rate = stream.average_rate or stream.guessed_rate
        video_fps = float(rate) if rate else 0.0
        if not 0 < video_fps <= MAX_SOURCE_FPS:
            raise InvalidArgument(f"{where}: the video's frame rate is {video_fps:g}; this server takes "
                                  f"(0, {MAX_SOURCE_FPS:g}] frames a second")
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise InvalidArgument(f"{where}: the video's frames have no size ({width}x{height})")
        if width * height > max_frame_pixels:
            raise InvalidArgument(f"{where}: the video's frames are {width}x{height} = {width * height} pixels, too "
                                  f"large: the server's limit is {max_frame_pixels} (--max-image-pixels)")
        most = int(sampling.max_seconds * video_fps)  # more frames than this is too long a video
        total = int(stream.frames) if stream.frames else _count_packets(box, stream, most + 1, where)
    if total <= 0:
        raise InvalidArgument(f"{where}: the video has no frames")
    if total > most:
        raise InvalidArgument(f"{where}: the video is {total / video_fps:.1f} s long ({total} frames at "
                              f"{video_fps:g} fps); the server's limit is {sampling.max_seconds:g} s "
                              "(--max-video-seconds)")
    indices = sample_indices(total, video_fps, sampling, temporal_patch_size)
    holding = before_decoding(len(indices), height, width) if before_decoding is not None else nullcontext()
    with holding:
        frames = _decode(av, data, demuxer, indices, (height, width), frame, where)
    return SampledVideo(frames, second_per_grid_t(len(indices), total, video_fps, temporal_patch_size), total,
                        video_fps, (height, width))


def _count_packets(box, stream, stop: int, where: str) -> int:
    """The video stream's frames, counted by its packets (no decoding), up to `stop`."""
    count = 0
    try:
        for packet in box.demux(stream):
            if packet.size:
                count += 1
                if count >= stop:
                    break
    except Exception as exc:  # noqa: BLE001 - any FFmpeg failure while demuxing: the file is corrupt
        raise InvalidArgument(f"{where}: corrupt or truncated video ({type(exc).__name__}: {exc})") from None
    return count


def _decode(av, data: bytes, demuxer: str, indices: list[int], size: tuple[int, int], frame: Callable[[object], T],
            where: str) -> list[T]:
    """`frame(rgb)` of the decoded frames at `indices` (sorted), in a fresh pass over the file."""
    wanted: dict[int, int] = {}
    for i in indices:
        wanted[i] = wanted.get(i, 0) + 1  # arange's float steps never repeat one, but a repeat costs nothing
    out: list[T] = []
    last = indices[-1]
    decoded = 0
    with _open(av, data, demuxer, where) as box:
        try:
            for i, picture in enumerate(box.decode(video=0)):
                decoded = i + 1
                if i > last:
                    break
                if i not in wanted:
                    continue
                if (picture.height, picture.width) != size:
                    raise InvalidArgument(f"{where}: frame {i} is {picture.width}x{picture.height}, the video's "
                                          f"others {size[1]}x{size[0]}: frames of one size only")
                made = frame(picture.to_ndarray(format="rgb24"))
                out.extend([made] * wanted[i])
        except InvalidArgument:
            raise
        except Exception as exc:  # noqa: BLE001 - any FFmpeg failure while decoding: the stream is corrupt
            raise InvalidArgument(f"{where}: corrupt or truncated video: decoding failed after {decoded} frames "
                                  f"({type(exc).__name__}: {exc})") from None
    if len(out) < len(indices):
        raise InvalidArgument(f"{where}: the video decodes to {decoded} frames but its header says more (frame "
                              f"{last} was to be sampled): corrupt or truncated")
    return out
