"""The gateway's configuration: its flags and one frozen value built from them once.

    config = GatewayConfig.from_args(build_parser().parse_args())   # ConfigError names a bad flag

The process flags (--host, --port, --metrics-port, --grace-period, --log-level) are the
ones every modalmesh server shares (modalmesh.flags); every flag is also MODALMESH_<FLAG>.
Fields keep the flags' names and units, so messages can name the flag a limit came from.
Nothing below the gateway's entry point reads `args`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from modalmesh.errors import ConfigError
from modalmesh.flags import ENV_PREFIX, EnvArgumentParser, add_process_arguments
from modalmesh.rpc.security import INSECURE, Security, add_security_arguments
from services.gateway.fetch import FetchPolicy, parse_networks


def build_parser() -> argparse.ArgumentParser:
    """The gateway's flags: the process flags every server shares (modalmesh.flags), then its own."""
    parser = EnvArgumentParser(
        prog="python -m services.gateway",
        description="modalmesh gateway: the OpenAI-compatible HTTP API in front of the LLM and VAE services.",
        epilog=f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}LLM=dns:///llm:50051).",
    )
    parser.add_argument("--llm", default=None, metavar="TARGET", help="LLM service, e.g. dns:///llm:50051")
    parser.add_argument("--more-llms", default=None, metavar="TARGET;...",
                        help="more LLM services, each serving its own model id (its Info's): a request's model picks "
                             "one, --llm serves requests that name none")
    parser.add_argument("--vae", default=None, metavar="TARGET", help="VAE service (for /v1/images/decode)")
    add_process_arguments(parser, port=8000, protocol="HTTP", what="requests")
    parser.add_argument("--served-model-name", default=None,
                        help="model id clients use (default: the LLM's model id from its Info)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve HTTPS with this certificate")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="... and this private key")
    add_security_arguments(parser, server=False)  # how the gateway calls the LLM and the VAE
    parser.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="allow file:// image and video URLs for files under DIR (off by default)")
    parser.add_argument("--allowed-media-domains", default=None, metavar="HOST,...",
                        help="fetch http(s) image and video URLs whose host is one of these (exactly); off by default")
    parser.add_argument("--allowed-media-networks", default=None, metavar="CIDR,...",
                        help="address ranges media URLs may reach although they are not public (private, loopback, "
                             "link-local: refused otherwise), e.g. 127.0.0.0/8 for images served on this host")
    parser.add_argument("--media-fetch-timeout", type=float, default=10.0,
                        help="seconds one image or video URL may take to fetch, redirects included")
    parser.add_argument("--max-media-redirects", type=int, default=3, help="redirects one media URL may take")
    parser.add_argument("--low-detail-max-pixels", type=int, default=512 * 512,
                        help="pixel budget of an image sent with detail 'low' (high / auto: the checkpoint's)")
    parser.add_argument("--max-request-mb", type=float, default=64.0, help="largest HTTP request body")
    parser.add_argument("--header-timeout", type=float, default=30.0,
                        help="seconds a connection may take to send a request's headers (and may stay idle between "
                             "requests) before it is closed")
    parser.add_argument("--body-timeout", type=float, default=60.0,
                        help="seconds a request's body may take to arrive: past it, 408")
    parser.add_argument("--max-inflight-body-mb", type=float, default=256.0,
                        help="request bodies being read and parsed at once, together; past it: 503 and Retry-After")
    parser.add_argument("--max-image-mb", type=float, default=20.0, help="largest image (decoded bytes)")
    parser.add_argument("--max-audio-mb", type=float, default=25.0, help="largest audio clip (decoded bytes)")
    parser.add_argument("--max-video-mb", type=float, default=32.0,
                        help="largest video file (decoded bytes); its frames are sampled by the vision encoder "
                             "(--video-fps, --max-video-frames there)")
    parser.add_argument("--max-message-mb", type=int, default=256, help="largest gRPC message sent/received")
    parser.add_argument("--request-timeout", type=float, default=0.0,
                        help="deadline of a Generate call in seconds (0: none)")
    parser.add_argument("--decode-timeout", type=float, default=300.0, help="deadline of a VAE Decode call")
    return parser


@dataclass(frozen=True)
class GatewayConfig:
    llm: str | None = None  # gRPC target of the LLM service
    more_llms: tuple[str, ...] = ()  # --more-llms: more LLM services, routed to by model id
    vae: str | None = None  # ... and of the VAE service (for /v1/images/decode)
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 9400
    grace_period: float = 30.0
    served_model_name: str | None = None
    api_key: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    local_media_root: Path | None = None  # --allowed-local-media-path, resolved
    max_request_mb: float = 64.0
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    max_inflight_body_mb: float = 256.0
    max_image_mb: float = 20.0
    max_audio_mb: float = 25.0
    max_video_mb: float = 32.0
    max_message_mb: int = 256
    request_timeout: float = 0.0  # 0: no deadline
    decode_timeout: float = 300.0
    security: Security = INSECURE  # how the gateway calls the LLM and the VAE
    fetch: FetchPolicy = FetchPolicy()  # --allowed-media-domains, --allowed-media-networks, --media-fetch-timeout, ...
    low_detail_max_pixels: int = 512 * 512

    def __post_init__(self):
        if not self.llm and not self.vae:
            raise ConfigError("give --llm TARGET (and/or --vae TARGET)")
        if self.more_llms and not self.llm:
            raise ConfigError("--more-llms needs --llm (the model of requests that name none)")
        for flag in ("max_request_mb", "max_image_mb", "max_audio_mb", "max_video_mb"):
            if getattr(self, flag) <= 0:
                raise ConfigError(f"--{flag.replace('_', '-')} must be > 0")
        if self.fetch.timeout_s <= 0:
            raise ConfigError("--media-fetch-timeout must be > 0")
        if self.fetch.max_redirects < 0:
            raise ConfigError("--max-media-redirects must be >= 0")
        if self.low_detail_max_pixels < 1:
            raise ConfigError("--low-detail-max-pixels must be >= 1")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ConfigError("--ssl-certfile and --ssl-keyfile go together")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        """The flags, checked before anything binds (readable security files included)."""
        config = cls(
            llm=args.llm, vae=args.vae,
            more_llms=tuple(t.strip() for t in (args.more_llms or "").split(";") if t.strip()),
            host=args.host, port=args.port, metrics_port=args.metrics_port,
            grace_period=args.grace_period, served_model_name=args.served_model_name, api_key=args.api_key,
            ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, max_request_mb=args.max_request_mb,
            header_timeout=args.header_timeout, body_timeout=args.body_timeout,
            max_inflight_body_mb=args.max_inflight_body_mb, max_image_mb=args.max_image_mb,
            max_audio_mb=args.max_audio_mb, max_video_mb=args.max_video_mb, max_message_mb=args.max_message_mb,
            request_timeout=args.request_timeout, decode_timeout=args.decode_timeout,
            fetch=fetch_policy(args), low_detail_max_pixels=args.low_detail_max_pixels,
        )
        root = args.allowed_local_media_path
        if root and not Path(root).is_dir():
            raise ConfigError(f"--allowed-local-media-path {root}: not a directory")
        # After the flags' own checks: the security files are read once, here.
        return dataclasses.replace(config, local_media_root=Path(root).resolve() if root else None,
                                   security=Security.from_args(args))


def fetch_policy(args: argparse.Namespace) -> FetchPolicy:
    # Hosts as urlsplit gives them: lower case, an IPv6 literal without its brackets ([::1] -> ::1).
    names = (args.allowed_media_domains or "").split(",")
    domains = frozenset(d.strip().lower().strip("[]") for d in names if d.strip())
    try:
        networks = parse_networks(args.allowed_media_networks)
    except ValueError as exc:
        raise ConfigError(f"--allowed-media-networks: {exc}") from None
    if networks and not domains:
        raise ConfigError("--allowed-media-networks without --allowed-media-domains: no URL would be fetched")
    return FetchPolicy(domains=domains, networks=networks, timeout_s=args.media_fetch_timeout,
                       max_redirects=args.max_media_redirects)
