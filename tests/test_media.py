"""Image inputs through the gateway with the official openai client: http(s) URLs fetched for allowed hosts only and
SSRF-safe (private, loopback and link-local addresses refused unless their range is allowed, redirects re-checked,
size and time limits), every format PIL decodes, and `detail` as a pixel budget.

Images are served from 127.0.0.1 by a small HTTP server in this process; the main gateway allows the loopback range
explicitly (--allowed-media-networks 127.0.0.0/8), a second one does not. The reference for a fetched image is the
same bytes sent inline (a data URL); for detail "low", transformers' smart_resize with the same max_pixels.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading

import numpy as np
import openai
import pytest
from PIL import Image

from modalmesh.ops.launcher import ServiceProcess
from modalmesh.testing import tiny
from services.gateway.launch import GatewayProcess

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu"]
GATEWAY = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace-period", "10"]
MAX_IMAGE_MB = 0.25
LOW_DETAIL_PIXELS = 28 * 28 * 8  # below the tiny checkpoint's own max_pixels (28 * 28 * 64)


def encode(image: Image.Image, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def rng_image(h, w, seed) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


PNG = encode(rng_image(56, 56, 3), "PNG")
BIG = encode(rng_image(400, 400, 4), "PNG")  # ~480 KB of noise: over the 0.25 MB limit
assert len(BIG) > MAX_IMAGE_MB * (1 << 20)


class MediaServer:
    """HTTP on 127.0.0.1: images, redirects, an oversize body with and without Content-Length, and a path that
    answers nothing until the test ends. It counts the requests it was sent."""

    def __init__(self):
        self.release = threading.Event()
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked bodies and keep-alive, as a real server sends them

            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append(self.path)
                path = self.path
                if path == "/cat.png":
                    return self._send(200, PNG)
                if path == "/big.png":
                    return self._send(200, BIG)
                if path == "/big-chunked.png":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(BIG), 1 << 15):
                        chunk = BIG[i:i + (1 << 15)]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.write(b"0\r\n\r\n")
                    return None
                if path == "/hang.png":
                    server.release.wait(120)  # released at teardown; the gateway gives up long before
                    return self._send(200, PNG)
                if path.startswith("/redirect?to="):
                    self.send_response(302)
                    self.send_header("Location", path.split("=", 1)[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if path == "/loop":
                    self.send_response(302)
                    self.send_header("Location", "/loop")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                return self._send(404, b"no")

            def _send(self, status, body):
                self.send_response(status)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path, host="127.0.0.1"):
        return f"http://{host}:{self.port}{path}"

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def media():
    server = MediaServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, media):
    vl = tiny.ensure("qwen2_vl", tmp_path_factory.mktemp("media"))
    vision = ServiceProcess("vision_encoder", [*COMMON, "--model", str(vl)]).start()
    procs = [vision]
    try:
        vision.wait_listening(timeout=180)
        llm = ServiceProcess("llm", [*COMMON, "--model", str(vl), "--kv-cache-tokens", "4096",
                                     "--vision-encoder", f"ipv4:{vision.target}"]).start()
        procs.append(llm)
        llm.wait_listening(timeout=180)
        fetching = ["--max-image-mb", str(MAX_IMAGE_MB), "--media-fetch-timeout", "1",
                    "--allowed-media-domains", "127.0.0.1,localhost,10.1.2.3,169.254.169.254,[::1]"]
        gw = GatewayProcess([*GATEWAY, "--llm", llm.target, *fetching, "--allowed-media-networks", "127.0.0.0/8",
                             "--low-detail-max-pixels", str(LOW_DETAIL_PIXELS)]).start()
        strict = GatewayProcess([*GATEWAY, "--llm", llm.target, *fetching]).start()  # no range allowed
        procs += [gw, strict]
        for p in procs:
            p.wait_serving(timeout=180)
        yield dict(vl=vl, gw=gw, strict=strict)
        for g in (gw, strict):
            assert g.terminate(timeout=30) == 0, g.log_tail()
    finally:
        for p in reversed(procs):
            p.terminate(timeout=60)


def client(gw):
    return openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(data, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def ask(gw, url, detail=None, n=6):
    image = {"url": url} if detail is None else {"url": url, "detail": detail}
    r = client(gw).chat.completions.create(
        model=client(gw).models.list().data[0].id, max_tokens=n, temperature=0.0, logprobs=True,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": image},
                                               {"type": "text", "text": "Describe this image."}]}])
    return [t.logprob for t in r.choices[0].logprobs.content], r.choices[0].message.content, r.usage.prompt_tokens


def refused(gw, url):
    with pytest.raises(openai.BadRequestError) as err:
        ask(gw, url, n=1)
    assert err.value.status_code == 400
    assert err.value.body["param"] == "messages[0].content[0].image_url.url", err.value.body
    assert "\n" not in err.value.message
    return err.value.body["code"], err.value.message


def test_an_image_url_equals_the_same_bytes_inline(stack, media):
    before = len(media.requests)
    fetched = ask(stack["gw"], media.url("/cat.png"))
    assert media.requests[before:] == ["/cat.png"]
    assert fetched == ask(stack["gw"], data_url(PNG))  # logprobs, text and prompt length: the same image
    # Through a redirect (re-checked, allowed) and by name (resolved, 127.0.0.1 allowed): the same.
    assert ask(stack["gw"], media.url("/redirect?to=/cat.png")) == fetched
    assert ask(stack["gw"], media.url("/cat.png", host="localhost")) == fetched


@pytest.mark.parametrize("path,code,words", [
    ("/big.png", "image_too_large", "at most"),  # Content-Length over the limit: refused before reading
    ("/big-chunked.png", "image_too_large", "more than"),  # no Content-Length: refused while reading
    ("/hang.png", "media_fetch_timeout", "longer than 1 s"),
    ("/nothing.png", "media_fetch_failed", "HTTP 404"),
    ("/loop", "media_fetch_failed", "more than 3 redirects"),
    ("/redirect?to=http://10.1.2.3/x.png", "media_address_not_allowed", "10.1.2.3 is a private address"),
    ("/redirect?to=http://169.254.169.254/latest/meta-data", "media_address_not_allowed", "link-local"),
    ("/redirect?to=http://example.com/x.png", "media_domain_not_allowed", "'example.com' is not in"),
    ("/redirect?to=file:///etc/passwd", "invalid_image_url", "only http(s)"),
])
def test_fetch_refusals_are_400s_naming_the_url(stack, media, path, code, words):
    got_code, message = refused(stack["gw"], media.url(path))
    assert got_code == code and words in message, message
    assert ask(stack["gw"], data_url(PNG), n=1)  # the gateway carries on


@pytest.mark.parametrize("url,code,words", [
    ("http://10.1.2.3/x.png", "media_address_not_allowed", "private"),
    ("http://169.254.169.254/latest/meta-data", "media_address_not_allowed", "link-local"),
    ("http://example.com/x.png", "media_domain_not_allowed", "--allowed-media-domains"),
    ("ftp://127.0.0.1/x.png", "invalid_image_url", "unsupported URL"),
])
def test_urls_refused_without_any_connection(stack, media, url, code, words):
    before = len(media.requests)
    got_code, message = refused(stack["gw"], url)
    assert got_code == code and words in message, message
    assert len(media.requests) == before


def test_loopback_is_refused_unless_its_range_is_allowed(stack, media):
    """The strict gateway allows the same hosts but no range: an IP literal is refused before connecting, a name
    when it resolves to 127.0.0.1 / ::1, so the media server is never reached."""
    before = len(media.requests)
    for url, words in ((media.url("/cat.png"), "127.0.0.1 is a loopback address"),
                       (media.url("/cat.png", host="localhost"), "localhost resolves to"),
                       (media.url("/cat.png", host="[::1]"), "::1 is a loopback address")):
        code, message = refused(stack["strict"], url)
        assert code == "media_address_not_allowed" and words in message, message
    assert len(media.requests) == before
    assert ask(stack["strict"], data_url(PNG), n=1)


@pytest.mark.parametrize("fmt,save", [("GIF", {}), ("BMP", {}), ("TIFF", {}), ("TIFF", {"compression": "tiff_lzw"}),
                                      ("WEBP", {"lossless": True})])
def test_formats_pil_decodes_equal_their_pixels_as_png(stack, fmt, save):
    """A GIF / BMP / TIFF image gives what a PNG of the pixels PIL decodes from it gives (GIF: its palette colours,
    first frame)."""
    image = rng_image(40, 52, 9)
    data = encode(image.convert("P") if fmt == "GIF" else image, fmt, **save)
    pixels = Image.open(io.BytesIO(data)).convert("RGB")
    want = ask(stack["gw"], data_url(encode(pixels, "PNG")))
    assert ask(stack["gw"], data_url(data, f"image/{fmt.lower()}")) == want


def test_an_animated_gif_is_its_first_frame(stack):
    frames = [rng_image(48, 48, s).convert("P") for s in (21, 22)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=80, loop=0)
    first, second = (encode(f.convert("RGB"), "PNG") for f in frames)
    got = ask(stack["gw"], data_url(data, "image/gif"))
    assert got == ask(stack["gw"], data_url(first))
    assert got[0] != ask(stack["gw"], data_url(second))[0]  # the frames tell apart: a real check of which one


def test_detail_low_is_a_pixel_budget_as_hf_resizes_with_it(stack):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    image = encode(rng_image(224, 224, 5), "PNG")
    lengths = {d: ask(stack["gw"], data_url(image), detail=d, n=1)[2] for d in (None, "auto", "high", "low")}
    rows = {}
    for name, budget in (("checkpoint", 28 * 28 * 64), ("low", LOW_DETAIL_PIXELS)):  # the tiny processor's max
        h, w = smart_resize(224, 224, factor=28, min_pixels=28 * 28 * 4, max_pixels=budget)
        rows[name] = (h // 28) * (w // 28)
    assert lengths["auto"] == lengths["high"] == lengths[None]
    assert lengths["low"] - rows["low"] == lengths[None] - rows["checkpoint"]  # the same text around fewer rows
    assert rows["low"] < rows["checkpoint"]
    with pytest.raises(openai.BadRequestError) as err:
        ask(stack["gw"], data_url(image), detail="medium", n=1)
    assert err.value.body["param"] == "messages[0].content[0].image_url.detail"
