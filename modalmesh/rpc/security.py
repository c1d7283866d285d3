"""How a process's gRPC traffic is protected: TLS (optionally mutual) and a shared bearer token.

    security = Security.from_files(token_file="/run/secrets/token", cert="tls.crt", key="tls.key",
                                   client_ca="ca.crt", ca="ca.crt")
    server.add_secure_port(addr, security.server_credentials())   # or insecure when None
    channel = aio_channel(target, security=security)               # TLS to servers signed by `ca`, token sent

One frozen value per process, for its server and its clients alike (the LLM
serves Generate and calls the encoders): the same token on every service of a
deployment lets the LLM, the VAE and the encoders refuse calls from anywhere
else. The token is compared in constant time. Health checks stay open (probes
carry no token); everything else needs ``authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

from modalmesh.errors import ConfigError

AUTHORIZATION = "authorization"


@dataclass(frozen=True, repr=False)  # no repr: it would print the token and the key
class Security:
    token: str | None = None  # shared bearer token
    cert: bytes | None = None  # this process's certificate chain (PEM): served, and shown to servers (mTLS)
    key: bytes | None = None  # its private key (PEM)
    client_ca: bytes | None = None  # server: clients must present a certificate signed by this (mTLS)
    ca: bytes | None = None  # client: servers' certificates are checked against this; set: TLS to them

    @classmethod
    def from_files(cls, *, token_file: str | None = None, cert: str | None = None, key: str | None = None,
                   client_ca: str | None = None, ca: str | None = None) -> Security:
        if bool(cert) != bool(key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if client_ca and not cert:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        token = None
        if token_file:
            token = _read(token_file, "--auth-token-file").decode().strip()
            if not token:
                raise ConfigError(f"--auth-token-file {token_file}: the file is empty")
        return cls(token=token, cert=_read(cert, "--tls-cert") if cert else None,
                   key=_read(key, "--tls-key") if key else None,
                   client_ca=_read(client_ca, "--tls-client-ca") if client_ca else None,
                   ca=_read(ca, "--tls-ca") if ca else None)

    @classmethod
    def from_args(cls, args) -> Security:
        """From the common flags (absent ones count as unset)."""
        return cls.from_files(token_file=getattr(args, "auth_token_file", None), cert=getattr(args, "tls_cert", None),
                              key=getattr(args, "tls_key", None), client_ca=getattr(args, "tls_client_ca", None),
                              ca=getattr(args, "tls_ca", None))

    # ---- server side ----------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)

    def authorized(self, metadata) -> bool:
        """Whether a call's metadata carries the token (always, without one)."""
        if self.token is None:
            return True
        want = f"Bearer {self.token}".encode()
        for name, value in metadata or ():
            if name == AUTHORIZATION:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, want)
        return False

    # ---- client side ----------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def client_interceptors(self) -> list:
        # One instance per call kind: grpc.aio files each interceptor under the first kind it matches.
        return [_UnaryToken(self.token), _StreamToken(self.token)] if self.token else []

    def call_metadata(self) -> list[tuple[str, str]]:
        return [(AUTHORIZATION, f"Bearer {self.token}")] if self.token else []


INSECURE = Security()


def add_security_arguments(parser, *, server: bool = True) -> None:
    g = parser.add_argument_group("security")
    g.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help="shared bearer token: required from callers (health excepted) and sent to the services "
                        "this one calls" if server else "shared bearer token sent with every call")
    if server:
        g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate chain")
        g.add_argument("--tls-key", default=None, metavar="PEM", help="... and this private key")
        g.add_argument("--tls-client-ca", default=None, metavar="PEM",
                       help="mutual TLS: callers must present a certificate signed by this CA")
    else:
        g.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate (mutual TLS)")
        g.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="call the services behind over TLS, checking their certificates against this CA")


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from None


class _Token:
    def __init__(self, token: str):
        self._header = (AUTHORIZATION, f"Bearer {token}")

    def _details(self, details):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryToken(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamToken(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)
