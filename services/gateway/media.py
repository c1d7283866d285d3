"""Image, video and audio inputs of OpenAI requests -> raw bytes for the LLM's encoder pools.

* ``image_url``: ``data:image/<type>;base64,<data>`` URLs; ``file://`` URLs only
  under ``--allowed-local-media-path``; http(s) URLs only for the hosts of
  ``--allowed-media-domains``, fetched by ``fetch.py`` (SSRF checks there); ``detail``
  ``low`` asks for a smaller pixel budget (``--low-detail-max-pixels``).
* ``video_url`` (vLLM's extension): ``data:video/<type>;base64,<data>``, ``file://`` and http(s)
  URLs as for images, under ``--max-video-mb``. The file goes to the vision encoder as it is: the
  encoder decodes it and samples its frames (``--video-fps``, ``--max-video-frames``; see
  services/vision_encoder/video.py), so only the compressed bytes travel.
* ``input_audio``: ``{"data": <base64>, "format": "wav" | "mp3" | "flac" | "ogg"}``,
  as the OpenAI schema has it (a ``data:audio/...;base64,`` prefix is tolerated).

Sizes are checked on the base64 length before anything is decoded. The bytes
themselves are checked by the encoder (format, pixel, frame and duration limits), whose
INVALID_ARGUMENT comes back to the client as a 400.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from services.gateway.errors import bad_request
from services.gateway.fetch import FetchPolicy, check_url

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


def _decoded_size(b64: str) -> int:
    n = len(b64)
    return n * 3 // 4 - b64[-2:].count("=") if n else 0


def _b64decode(payload: str, *, what: str, param: str, max_bytes: int, code: str) -> bytes:
    payload = payload.strip()
    size = _decoded_size(payload)
    if size > max_bytes:
        raise bad_request(f"{what} is {size} bytes; this server accepts at most {max_bytes} bytes", param,
                          f"{code}_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{what}: the data is not valid base64", param, f"invalid_{code}") from None
    if not data:
        raise bad_request(f"{what}: the data is empty", param, f"invalid_{code}")
    return data


def parse_data_url(url: str, *, what: str, param: str, kind: str, max_bytes: int) -> bytes:
    """``data:<kind>/<subtype>[;...];base64,<payload>`` -> bytes."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise bad_request(f"{what}: malformed data URL (no ',' after the media type)", param, f"invalid_{kind}_url")
    fields = [f.strip().lower() for f in header[len("data:"):].split(";")]
    media_type, params = fields[0], fields[1:]
    if "base64" not in params:
        raise bad_request(f"{what}: only base64 data URLs are accepted (data:{kind}/...;base64,...)", param,
                          f"invalid_{kind}_url")
    if media_type and not media_type.startswith(f"{kind}/"):
        raise bad_request(f"{what}: media type {media_type!r} is not {kind}/*", param, f"invalid_{kind}_url")
    return _b64decode(payload, what=what, param=param, max_bytes=max_bytes, code=kind)


def read_file_url(url: str, *, what: str, param: str, root: Path | None, max_bytes: int,
                  kind: str = "image") -> bytes:
    """``file:///abs/path`` under the allowed root -> bytes."""
    if root is None:
        raise bad_request(f"{what}: file:// URLs are disabled; start the gateway with --allowed-local-media-path DIR "
                          "to serve files from DIR, or send a data: URL", param, "file_urls_disabled")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise bad_request(f"{what}: file URL with host {parts.netloc!r}; use file:///absolute/path", param,
                          f"invalid_{kind}_url")
    path = Path(unquote(parts.path))
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise bad_request(f"{what}: {path} does not exist", param, f"invalid_{kind}_url") from None
    if not resolved.is_relative_to(root) or not resolved.is_file():
        raise bad_request(f"{what}: {path} is not a file under the allowed media path", param, f"invalid_{kind}_url")
    size = resolved.stat().st_size
    if size > max_bytes:
        raise bad_request(f"{what} is {size} bytes; this server accepts at most {max_bytes} bytes", param,
                          f"{kind}_too_large")
    if not os.access(resolved, os.R_OK):
        raise bad_request(f"{what}: {path} is not readable", param, f"invalid_{kind}_url")
    return resolved.read_bytes()


@dataclass(frozen=True)
class ImageInput:
    """An ``image_url`` part: its bytes, or the http(s) URL to fetch them from (checked already), and its detail."""
    data: bytes | None
    url: str | None
    param: str  # the request path of the URL, for errors
    detail: str  # "auto" | "low" | "high"


DETAILS = ("auto", "low", "high")


def image_input(part: dict, *, param: str, max_bytes: int, local_root: Path | None,
                fetch: FetchPolicy = FetchPolicy()) -> ImageInput:
    """The image of an ``image_url`` content part; an http(s) URL is checked against `fetch` (no network)
    and left for the gateway to fetch."""
    spec = part.get("image_url")
    detail = "auto"
    if isinstance(spec, dict):
        url = spec.get("url")
        param_url = f"{param}.image_url.url"
        detail = spec.get("detail", "auto")
        if detail not in DETAILS:
            raise bad_request(f"image_url.detail must be one of {', '.join(DETAILS)}, got {detail!r}",
                              f"{param}.image_url.detail", "invalid_image_detail")
    else:  # vLLM also accepts the URL as a bare string
        url, param_url = spec, f"{param}.image_url"
    if not isinstance(url, str) or not url:
        raise bad_request("image_url part needs image_url.url (a data: URL)", param_url, "invalid_image_url")
    what = f"{param_url}"
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return ImageInput(parse_data_url(url, what=what, param=param_url, kind="image", max_bytes=max_bytes), None,
                          param_url, detail)
    if scheme == "file":
        return ImageInput(read_file_url(url, what=what, param=param_url, root=local_root, max_bytes=max_bytes), None,
                          param_url, detail)
    if scheme in ("http", "https"):
        check_url(fetch, url, what=what, param=param_url)
        return ImageInput(None, url, param_url, detail)
    raise bad_request(f"{what}: unsupported URL (expected data:image/<type>;base64,...)", param_url,
                      "invalid_image_url")


@dataclass(frozen=True)
class VideoInput:
    """A ``video_url`` part: its bytes, or the http(s) URL to fetch them from (checked already)."""
    data: bytes | None
    url: str | None
    param: str  # the request path of the URL, for errors


def video_input(part: dict, *, param: str, max_bytes: int, local_root: Path | None,
                fetch: FetchPolicy = FetchPolicy()) -> VideoInput:
    """The video of a ``video_url`` content part (vLLM's form); an http(s) URL is checked against `fetch` (no
    network) and left for the gateway to fetch."""
    spec = part.get("video_url")
    if isinstance(spec, dict):
        url, param_url = spec.get("url"), f"{param}.video_url.url"
    else:  # as for images, the URL as a bare string
        url, param_url = spec, f"{param}.video_url"
    if not isinstance(url, str) or not url:
        raise bad_request("video_url part needs video_url.url (a data:video/<type>;base64,... URL)", param_url,
                          "invalid_video_url")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return VideoInput(parse_data_url(url, what=param_url, param=param_url, kind="video", max_bytes=max_bytes),
                          None, param_url)
    if scheme == "file":
        return VideoInput(read_file_url(url, what=param_url, param=param_url, root=local_root, max_bytes=max_bytes,
                                        kind="video"), None, param_url)
    if scheme in ("http", "https"):
        check_url(fetch, url, what=param_url, param=param_url, kind="video")
        return VideoInput(None, url, param_url)
    raise bad_request(f"{param_url}: unsupported URL (expected data:video/<type>;base64,...)", param_url,
                      "invalid_video_url")


def audio_bytes(part: dict, *, param: str, max_bytes: int) -> bytes:
    """The bytes of an ``input_audio`` content part."""
    spec = part.get("input_audio")
    if not isinstance(spec, dict):
        raise bad_request("input_audio part needs input_audio: {data, format}", f"{param}.input_audio",
                          "invalid_audio")
    fmt = spec.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMATS):
        raise bad_request(f"input_audio.format {fmt!r} is not supported; use one of {', '.join(AUDIO_FORMATS)}",
                          f"{param}.input_audio.format", "invalid_audio_format")
    data = spec.get("data")
    pdata = f"{param}.input_audio.data"
    if not isinstance(data, str) or not data:
        raise bad_request("input_audio.data must be a base64 string", pdata, "invalid_audio")
    if data[:5].lower() == "data:":
        return parse_data_url(data, what=pdata, param=pdata, kind="audio", max_bytes=max_bytes)
    return _b64decode(data, what=pdata, param=pdata, max_bytes=max_bytes, code="audio")

