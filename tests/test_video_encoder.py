"""Video in the vision encoder: frames sampled, preprocessed and encoded as transformers' video path does it.

References, all fp32 on the CPU: the frame indices are transformers' own Qwen2VLVideoProcessor.sample_frames
(compiled from its source: the module imports torchvision, which cannot be installed here); the frames are
decoded by transformers' read_video_pyav; each frame is rescaled and normalised by the checkpoint's PIL image
processor at the video's one target size, and laid out by the video processor's own patchify; the tower's
rows equal Qwen2VLModel / Qwen2_5_VLModel.get_video_features on those pixel_values_videos. Bad input is
INVALID_ARGUMENT naming the item and the problem.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys

import numpy as np
import pytest
import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.testing import tiny
from modalmesh.testing.precision import ieee_fp32_convolutions
from modalmesh.testing.video import hf_processor_defaults, hf_video_inputs, hf_video_method, make_video
from services.vision_encoder import preprocess as pp
from services.vision_encoder import video as vd
from services.vision_encoder.model import build_encoder_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_encoder")
    return {name: tiny.ensure(name, root) for name in ("qwen2_vl", "qwen2_5_vl", "siglip")}


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: build_encoder_model(path, device="cpu", dtype=torch.float32) for name, path in checkpoints.items()}


# (total frames, the video's fps, fps sampled, max_frames, min_frames)
SAMPLING_CASES = [
    (12, 8.0, 2.0, 64, 4),  # 1.5 s: 3 frames by fps, raised to min_frames 4
    (240, 30.0, 2.0, 64, 4),  # 8 s: 16 frames
    (300, 30.0, 2.0, 8, 4),  # 10 s capped at 8 frames: spread over the whole video
    (301, 29.97, 2.0, 64, 4),  # a fractional rate: 20.08 frames, rounded down to 20
    (299, 29.97, 3.0, 15, 4),  # an odd cap: rounded down to 14
    (7, 25.0, 2.0, 64, 4),  # shorter than min_frames' time: 4 of 7
    (3, 25.0, 2.0, 64, 4),  # fewer frames than min_frames: 2 (the count rounded down to the temporal patch)
    (2, 25.0, 2.0, 64, 4),  # exactly one temporal patch
    (1000, 24.0, 0.5, 64, 4),  # a slow rate: 20 frames of 41.7 s
    (5000, 240.0, 2.0, 64, 1),  # a fast source
    (17, 1.0, 2.0, 64, 4),  # a source slower than the rate asked: every frame but the last (an odd count)
]


@pytest.mark.parametrize("total,video_fps,fps,max_frames,min_frames", SAMPLING_CASES)
def test_frame_indices_are_transformers_sample_frames(total, video_fps, fps, max_frames, min_frames):
    hf = hf_video_method("sample_frames")
    metadata = type("Metadata", (), {"total_num_frames": total, "fps": video_fps})()
    want = hf(hf_processor_defaults(), metadata, fps=fps, max_frames=max_frames, min_frames=min_frames).tolist()
    sampling = vd.VideoSampling(fps=fps, min_frames=min_frames, max_frames=max_frames)
    got = vd.sample_indices(total, video_fps, sampling, temporal_patch_size=2)
    assert got == want and len(got) % 2 == 0 and len(set(got)) == len(got)
    assert vd.second_per_grid_t(len(got), total, video_fps, 2) == pytest.approx(2 / (len(want) / total * video_fps),
                                                                                   rel=1e-12)


def test_a_video_shorter_than_a_temporal_patch_gives_its_frames_where_transformers_divides_by_zero():
    hf = hf_video_method("sample_frames")
    metadata = type("Metadata", (), {"total_num_frames": 1, "fps": 8.0})()
    with pytest.raises(ZeroDivisionError):
        hf(hf_processor_defaults(), metadata, fps=2.0)
    assert vd.sample_indices(1, 8.0, vd.VideoSampling(), temporal_patch_size=2) == [0]


@pytest.mark.parametrize("frames", [4, 3, 1])
def test_temporal_patches_are_transformers_patchify(frames):
    """Consecutive frames paired, an odd last frame repeated: the video processor's own patchify, bit for bit."""
    cfg = pp.ImageProcessorConfig(kind="qwen2_vl", patch_size=14, merge_size=2, temporal_patch_size=2)
    rng = np.random.default_rng(frames)
    video = [rng.standard_normal((56, 84, 3)).astype(np.float32) for _ in range(frames)]
    rows, grid = pp.video_patches(video, cfg)
    want, t, h, w = hf_video_method("patchify")(
        None, torch.from_numpy(np.stack(video)).permute(0, 3, 1, 2)[None], 14, 2, 2)
    assert grid == (t, h, w) == (-(-frames // 2), 4, 6)
    assert torch.equal(torch.from_numpy(rows), want[0])


@pytest.mark.parametrize("frames,fps,container,codec", [(13, 8, "mp4", "mpeg4"), (20, 10, "mp4", "libx264"),
                                                         (9, 6, "webm", "libvpx")])
def test_a_video_file_preprocesses_as_hf_reads_samples_and_processes_it(models, checkpoints, tmp_path, frames, fps,
                                                                         container, codec):
    # The dev extra pins PyAV (av==18.1.0), whose wheel carries all three encoders: a build without one is a
    # broken test environment, not a case to pass over.
    assert codec in __import__("av").codecs_available, f"this PyAV build has no {codec} encoder"
    data = make_video(frames, fps, container=container, codec=codec)
    path = tmp_path / f"clip.{container}"
    path.write_bytes(data)
    model = models["qwen2_vl"]
    prepared = model.prepare(pb.EncodeItem(video=data), 0)
    if container == "webm":  # no frame count in its header: transformers' reader would see 0 frames; ours counts
        import av

        with av.open(str(path)) as box:
            assert box.streams.video[0].frames == 0
        total = frames
        indices = vd.sample_indices(total, fps, model.video_sampling, 2)
        seconds = 2 / (len(indices) / total * fps)
        assert prepared.meta["second_per_grid_t"] == pytest.approx(seconds, rel=1e-12)
        return
    want, grid, seconds = hf_video_inputs(path, checkpoints["qwen2_vl"], fps=2.0, max_frames=64)
    assert prepared.meta["grid_thw"] == tuple(grid) and grid[0] > 1
    assert prepared.meta["second_per_grid_t"] == pytest.approx(seconds, rel=1e-12)
    assert torch.equal(prepared.inputs["pixel_values"], want)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_video_rows_equal_hf_get_video_features(models, checkpoints, tmp_path, name):
    """The tower's rows for a video (alone, and batched with an image and a second video) equal HF's video path."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    cls = Qwen2VLForConditionalGeneration if name == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    ref = cls.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
    model = models[name]
    clips = [make_video(13, 8), make_video(24, 12, width=96, height=80)]
    items, wants = [], []
    for i, data in enumerate(clips):
        path = tmp_path / f"{name}-{i}.mp4"
        path.write_bytes(data)
        pixels, grid, _ = hf_video_inputs(path, checkpoints[name], fps=2.0, max_frames=64)
        with torch.no_grad():
            out = ref.model.get_video_features(pixels, video_grid_thw=torch.tensor([grid]))
        wants.append(torch.cat(list(out.pooler_output)))
        items.append(pb.EncodeItem(video=data))
    image = pb.EncodeItem(pixels=pb.Tensor(dtype=pb.UINT8, shape=[56, 84, 3], data=bytes(56 * 84 * 3)))
    alone = model.encode([model.prepare(items[0], 0)])[0]
    batch = model.encode([model.prepare(items[0], 0), model.prepare(image, 1), model.prepare(items[1], 2)])
    for got in (alone, batch[0]):
        assert got.embedding.shape == wants[0].shape and got.grid_thw[0] == 2
        torch.testing.assert_close(got.embedding, wants[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[2].embedding, wants[1], atol=1e-5, rtol=1e-5)
    assert batch[1].grid_thw[0] == 1 and batch[1].second_per_grid_t == 0.0 and batch[0].second_per_grid_t > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_the_device_path_encodes_videos_beside_its_images(checkpoints, device):
    """With preprocessing on the device, a video (preprocessed on the CPU) in a batch of images gets the CPU
    path's rows; the images keep theirs. On CUDA the batch runs as two forwards on the GPU, its answers stay
    there, and the video's rows still equal the CPU model's (IEEE fp32: the kernels differ by rounding only)."""
    cpu = build_encoder_model(checkpoints["qwen2_vl"], device="cpu", dtype=torch.float32)
    ours = build_encoder_model(checkpoints["qwen2_vl"], device=device, dtype=torch.float32,
                               options={"preprocess_device": "device"})
    assert ours.preprocess == "device"
    pixels = np.random.default_rng(7).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    image = pb.EncodeItem(pixels=pb.Tensor(dtype=pb.UINT8, shape=[56, 56, 3], data=pixels.tobytes()))
    video = pb.EncodeItem(video=make_video(13, 8))
    with ieee_fp32_convolutions() if device == "cuda" else contextlib.nullcontext():
        got = ours.encode([ours.prepare(image, 0), ours.prepare(video, 1), ours.prepare(image, 2)])
        want_image = ours.encode([ours.prepare(image, 0)])[0]
    assert all(g.embedding.device.type == device for g in got)
    want_video = cpu.encode([cpu.prepare(video, 0)])[0]
    def close(got, want):  # CUDA: other kernels (and per batch layout), so rounding in the last bits
        tol = 1e-5 if device == "cpu" else 1e-4 * want.abs().max().item()
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=tol, rtol=1e-5 if device == "cpu" else 1e-4)

    close(got[1].embedding, want_video.embedding)
    for i in (0, 2):
        close(got[i].embedding, want_image.embedding)
    assert got[1].grid_thw == want_video.grid_thw and got[0].grid_thw[0] == 1


def test_the_sampling_flags_and_a_video_processor_config_change_the_grid(checkpoints, tmp_path):
    data = make_video(40, 8)  # 5 s: 10 frames at 2 fps
    base = build_encoder_model(checkpoints["qwen2_vl"], device="cpu", dtype=torch.float32)
    assert base.prepare(pb.EncodeItem(video=data), 0).meta["grid_thw"] == (5, 4, 4)
    fewer = build_encoder_model(checkpoints["qwen2_vl"], device="cpu", dtype=torch.float32,
                                options={"max_video_frames": 7, "video_fps": 1.0})
    assert fewer.prepare(pb.EncodeItem(video=data), 0).meta["grid_thw"] == (2, 4, 4)  # 5 frames, capped at 6: 4
    assert fewer.cache_key(pb.EncodeItem(video=data), 0) != base.cache_key(pb.EncodeItem(video=data), 0)
    # video_preprocessor_config.json, when there, is the video processor's (transformers' order): its budget and
    # its max_frames (below the flag's); images keep theirs
    own = shutil.copytree(checkpoints["qwen2_vl"], tmp_path / "own-video-config")
    (own / "video_preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 8, "patch_size": 14, "merge_size": 2,
         "temporal_patch_size": 2, "max_frames": 6}))
    model = build_encoder_model(own, device="cpu", dtype=torch.float32)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    height, width = smart_resize(48, 64, factor=28, min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 8)
    assert model.prepare(pb.EncodeItem(video=data), 0).meta["grid_thw"] == (3, height // 14, width // 14) != (3, 4, 4)
    image = pb.EncodeItem(pixels=pb.Tensor(dtype=pb.UINT8, shape=[48, 64, 3], data=bytes(48 * 64 * 3)))
    assert model.prepare(image, 0).meta["grid_thw"] == base.prepare(image, 0).meta["grid_thw"]


def _refused(model, item, *words):
    with pytest.raises(InvalidArgument) as err:
        model.prepare(item, 3, model.cache_key(item, 3))
    message = str(err.value)
    assert message.startswith("items[3]") and all(w in message for w in words), message
    return message


def _no_frames(container: str, codec: str) -> bytes:
    """A file with a video stream and not one frame in it."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def test_bad_videos_are_invalid_argument_naming_the_problem(models, checkpoints):
    model = models["qwen2_vl"]
    good = make_video(12, 8)
    _refused(model, pb.EncodeItem(video=b"\x89PNG\r\n\x1a\n" + bytes(40)), "not a video", "MP4 / MOV")
    _refused(model, pb.EncodeItem(video=good[:40] + bytes(range(256)) * 8), "corrupt or truncated")
    _refused(model, pb.EncodeItem(video=good[:len(good) // 3]), "corrupt or truncated")
    # FFmpeg drops an MP4's empty track (no stream at all) and cannot open an empty WebM; an AVI keeps an empty stream
    for container, codec, words in (("mp4", "mpeg4", "has no video stream"), ("webm", "libvpx", "End of file"),
                                    ("avi", "mpeg4", "has no frames")):
        _refused(model, pb.EncodeItem(video=_no_frames(container, codec)), words)
    _refused(model, pb.EncodeItem(video=b""), "empty video")
    # An HLS playlist is never opened (it would make FFmpeg fetch what it names)
    _refused(model, pb.EncodeItem(video=b"#EXTM3U\n#EXTINF:1,\nhttp://169.254.169.254/x.ts\n"), "not a video")
    strict = build_encoder_model(checkpoints["qwen2_vl"], device="cpu", dtype=torch.float32,
                                 options={"max_video_seconds": 1.0, "max_image_pixels": 64 * 48})
    _refused(strict, pb.EncodeItem(video=good), "1.5 s long", "--max-video-seconds")
    _refused(strict, pb.EncodeItem(video=make_video(4, 8, width=96, height=64)), "96x64", "--max-image-pixels")
    small = build_encoder_model(checkpoints["qwen2_vl"], device="cpu", dtype=torch.float32,
                                options={"decode_memory_bytes": 100_000})
    _refused(small, pb.EncodeItem(video=make_video(16, 8, width=224, height=224)), "decoding this video",
             "--decode-memory-mb")
    assert model.prepare(pb.EncodeItem(video=good), 0).meta["grid_thw"][0] == 2  # and it goes on


def test_siglip_refuses_video_naming_its_model(models):
    message = _refused(models["siglip"], pb.EncodeItem(video=make_video(4, 8)), "Qwen2-VL / Qwen2.5-VL")
    assert "SiglipVisionModel" in message and "images only" in message
    assert "video" not in models["siglip"].describe()


def test_without_pyav_a_video_names_the_extra(models, monkeypatch):
    mp4 = make_video(4, 8)  # made before PyAV is hidden
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    _refused(models["qwen2_vl"], pb.EncodeItem(video=mp4), "PyAV is not installed", "modalmesh[video]")
    assert models["qwen2_vl"].describe()["video"].startswith("off: PyAV is not installed")
