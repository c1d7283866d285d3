"""Video through the whole stack with the official openai client: a `video_url` data URL to the gateway, decoded and
sampled by the vision encoder, spliced by the LLM with its M-RoPE positions.

Reference: transformers' own video path on the same file (tiny random Qwen2-VL and Qwen2.5-VL, fp32, CPU): its
read_video_pyav with Qwen2VLVideoProcessor.sample_frames, the PIL image processor per frame and the video
processor's patchify (modalmesh/testing/video.py), the chat template rendered by apply_chat_template, then
`generate(pixel_values_videos=..., video_grid_thw=..., second_per_grid_ts=...)`: greedy tokens equal, logprobs
within 1e-4. Qwen2.5-VL's encoder samples at 3 fps, so its temporal steps are 2/3 s apart (positions 0, 2, 5, ...:
float32 truncation). The same video twice is answered from the prefix cache without a second Encode; bad videos
are 400s naming the part and the problem, and the stack keeps serving.
"""

from __future__ import annotations

import base64
import functools
import http.server
import threading
import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from modalmesh.ops.launcher import ServiceProcess
from modalmesh.testing import tiny
from modalmesh.testing.video import hf_video_inputs, make_video
from services.gateway.launch import GatewayProcess
from tests.test_media import client  # the openai client on a gateway

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu"]
GATEWAY = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace-period", "10"]
N = 8
FPS = {"qwen2_vl": 2.0, "qwen2_5_vl": 3.0}
MAX_VIDEO_MB = 0.5


CLIP = make_video(12, 8)


class _Files(http.server.BaseHTTPRequestHandler):
    """http://127.0.0.1:PORT/clip.mp4 (CLIP) and /big.mp4 (over --max-video-mb)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = {"/clip.mp4": CLIP, "/big.mp4": bytes(700_000)}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")


@pytest.fixture(scope="module")
def files():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield functools.partial("http://127.0.0.1:{}{}".format, server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_stack")
    dirs = {name: tiny.ensure(name, root) for name in ("qwen2_vl", "qwen2_5_vl", "qwen2")}
    procs = []
    try:
        vision = {}
        for name in ("qwen2_vl", "qwen2_5_vl"):
            extra = ["--video-fps", str(FPS[name])]
            if name == "qwen2_5_vl":  # limits to refuse by
                extra += ["--max-video-seconds", "3", "--max-image-pixels", str(160 * 120)]
            vision[name] = ServiceProcess("vision_encoder", [*COMMON, "--model", str(dirs[name]), *extra]).start()
            procs.append(vision[name])
        for p in vision.values():
            p.wait_listening(timeout=180)
        llms = {}
        for name in ("qwen2_vl", "qwen2_5_vl", "qwen2"):
            encoder = ["--vision-encoder", f"ipv4:{vision[name].target}"] if name in vision else []
            llms[name] = ServiceProcess("llm", [*COMMON, "--model", str(dirs[name]), "--kv-cache-tokens", "4096",
                                                *encoder]).start()
            procs.append(llms[name])
        for p in llms.values():
            p.wait_listening(timeout=180)
        gw = GatewayProcess([*GATEWAY, "--llm", llms["qwen2_vl"].target, "--max-video-mb", str(MAX_VIDEO_MB),
                             "--allowed-media-domains", "127.0.0.1", "--allowed-media-networks", "127.0.0.0/8",
                             "--more-llms", f"{llms['qwen2_5_vl'].target};{llms['qwen2'].target}"]).start()
        procs.append(gw)
        for p in procs:
            p.wait_serving(timeout=180)
        yield dict(dirs=dirs, gw=gw, vision=vision)
        assert gw.terminate(timeout=30) == 0, gw.log_tail()
    finally:
        for p in reversed(procs):
            p.terminate(timeout=60)


def video_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def ask(gw, model: str, url: str, n: int = N):
    r = client(gw).chat.completions.create(
        model=model, max_tokens=n, temperature=0.0, logprobs=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                               {"type": "text", "text": "Describe this video."}]}])
    content = r.choices[0].logprobs.content
    return [t.token for t in content], [t.logprob for t in content], r.usage


def encoded_items(vision: ServiceProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{vision.metrics_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "modalmesh_encoded_items_total")


def hf_reference(path, model: str, video_file, n: int = N):
    """Token strings, logprobs and prompt length of HF's generate on the same video file and chat."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    cls = Qwen2VLForConditionalGeneration if model == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    ref = cls.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    pixels, grid, seconds = hf_video_inputs(video_file, path, fps=FPS[model], max_frames=64)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe this video."}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|video_pad|><|vision_end|>" in text
    rows = grid[0] * grid[1] * grid[2] // 4
    input_ids = tok(text.replace("<|video_pad|>", "<|video_pad|>" * rows), return_tensors="pt",
                    add_special_tokens=False)["input_ids"]
    extra = {"second_per_grid_ts": torch.tensor([seconds])} if model == "qwen2_5_vl" else {}
    with torch.no_grad():
        out = ref.generate(input_ids=input_ids, pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]),
                           mm_token_type_ids=(input_ids == ref.config.video_token_id).int() * 2, max_new_tokens=n,
                           do_sample=False, output_logits=True, return_dict_in_generate=True, **extra)
    ids = out.sequences[0, input_ids.shape[1]:].tolist()
    lps = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, ids)]
    return [tok.decode([t]) for t in ids], lps, input_ids.shape[1], grid, seconds


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl"])
def test_a_video_url_equals_hf_generate_on_the_same_frames(stack, model, tmp_path):
    data = make_video(16, 8)  # 2 s: 4 frames at 2 fps, 6 at 3 fps
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    want_tokens, want_lps, prompt_len, grid, seconds = hf_reference(stack["dirs"][model], model, path)
    assert grid[0] == (2 if model == "qwen2_vl" else 3)
    if model == "qwen2_5_vl":
        assert seconds == pytest.approx(2 / 3)  # tokens_per_second 4: temporal positions 0, 2, 5
    tokens, lps, usage = ask(stack["gw"], model, video_url(data))
    assert tokens == want_tokens and len(set(tokens)) > 2
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4, rtol=0)
    assert usage.prompt_tokens == prompt_len


def test_the_same_video_again_is_not_encoded_again_and_another_never_matches(stack):
    gw, vision = stack["gw"], stack["vision"]["qwen2_vl"]
    clip, other = make_video(13, 8, width=64, height=48), make_video(13, 8, width=64, height=48, codec="libx264")
    before = encoded_items(vision)
    first = ask(gw, "qwen2_vl", video_url(clip), n=2)
    assert encoded_items(vision) == before + 1
    again = ask(gw, "qwen2_vl", video_url(clip), n=2)
    assert encoded_items(vision) == before + 1  # its rows' K/V came from the prefix cache: no Encode
    assert again[2].prompt_tokens_details.cached_tokens >= 16  # the first page, the video's rows inside it
    assert again[0] == first[0]  # the same tokens; logprobs as a cached prefix's prefill gives them (not bitwise)
    torch.testing.assert_close(torch.tensor(again[1]), torch.tensor(first[1]), atol=1e-4, rtol=0)
    different = ask(gw, "qwen2_vl", video_url(other), n=2)
    assert encoded_items(vision) == before + 2
    cached = different[2].prompt_tokens_details
    assert (cached.cached_tokens if cached else 0) == 0  # its rows sit in the first page: no page of it matches
    assert different[2].prompt_tokens == first[2].prompt_tokens  # the same grid: only the content differs


def refused(gw, model: str, url: str, param: str = "messages[0].content[0]"):
    with pytest.raises(openai.BadRequestError) as err:
        ask(gw, model, url, n=1)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    return err.value.body["code"], err.value.message


def _avi_without_frames() -> bytes:
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()
    return buf.getvalue()


@pytest.mark.parametrize("model,url,code,words", [
    ("qwen2_vl", video_url(b"\x00\x00\x00\x1cftypisom" + bytes(300)), "invalid_argument", "corrupt or truncated"),
    ("qwen2_vl", video_url(b"GIF89a" + bytes(64), "video/gif"), "invalid_argument", "not a video this server decodes"),
    ("qwen2_vl", video_url(_avi_without_frames(), "video/x-msvideo"), "invalid_argument", "the video has no frames"),
    ("qwen2_5_vl", video_url(make_video(40, 8)), "invalid_argument", "5.0 s long"),  # --max-video-seconds 3
    ("qwen2_5_vl", video_url(make_video(2, 8, width=224, height=112)), "invalid_argument", "--max-image-pixels"),
    ("qwen2", video_url(make_video(4, 8)), "invalid_argument", "takes no VIDEO input"),
])
def test_bad_videos_are_400s_naming_the_part_and_the_stack_keeps_serving(stack, model, url, code, words):
    got_code, message = refused(stack["gw"], model, url)
    assert got_code == code and words in message, message
    assert ask(stack["gw"], "qwen2_vl", video_url(make_video(12, 8)), n=1)[0]


def test_gateway_refusals_before_any_service(stack):
    gw = stack["gw"]
    code, message = refused(gw, "qwen2_vl", video_url(bytes(700_000)), "messages[0].content[0].video_url.url")
    assert code == "video_too_large" and "at most" in message
    code, message = refused(gw, "qwen2_vl", video_url(b"abc", "image/png"), "messages[0].content[0].video_url.url")
    assert code == "invalid_video_url" and "not video/*" in message
    code, message = refused(gw, "qwen2_vl", "https://example.com/clip.mp4", "messages[0].content[0].video_url.url")
    assert code == "media_domain_not_allowed" and "--allowed-media-domains" in message


def test_a_video_http_url_is_fetched_as_images_are_and_equals_it_inline(stack, files):
    """Through the same SSRF-checked fetcher as images (the loopback range allowed explicitly here)."""
    gw = stack["gw"]
    fetched, inline = ask(gw, "qwen2_vl", files("/clip.mp4"), n=3), ask(gw, "qwen2_vl", video_url(CLIP), n=3)
    assert fetched[0] == inline[0] and fetched[2].prompt_tokens == inline[2].prompt_tokens
    torch.testing.assert_close(torch.tensor(fetched[1]), torch.tensor(inline[1]), atol=1e-4, rtol=0)
    code, message = refused(gw, "qwen2_vl", files("/big.mp4"), "messages[0].content[0].video_url.url")
    assert code == "video_too_large" and "at most 524288 bytes" in message
