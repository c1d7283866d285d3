"""Command-line flags of every modalmesh server process: env-aware, defaults shown in --help.

    parser = EnvArgumentParser(prog="python -m services.gateway", description=...)
    add_process_arguments(parser, port=8000, protocol="HTTP")  # --host --port --metrics-port
                                                               # --grace-period --log-level
                                                               # --log-format --otlp-traces-endpoint
    args = parser.parse_args()                                 # MODALMESH_PORT=9000 sets --port's default

Every option defaults to the environment variable ``MODALMESH_<DEST>`` when it is set
(compose files and Kubernetes manifests configure services that way); a flag on the
command line still wins. A value the flag's type rejects fails parsing naming the
variable. Nothing here imports torch or grpc: ``--help`` stays cheap.
"""

from __future__ import annotations

import argparse
import copy
import os

ENV_PREFIX = "MODALMESH_"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")  # --log-format (modalmesh.logs)
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype (modalmesh.service maps them to torch dtypes)


def env_name(dest: str) -> str:
    """The environment variable that sets the flag with this `dest`: ``port`` -> ``MODALMESH_PORT``."""
    return ENV_PREFIX + dest.upper()


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help when it has a default worth showing (not None, not a
    switch's False), so ``--help`` says what happens when the flag is left out."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.default is not None \
            and action.default is not argparse.SUPPRESS and not isinstance(action, (
                argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not self._shows_default(action):
            return text
        return f"{text} (default: %(default)s)"

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._shows_default(action):  # a flag without help still shows its default
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to ``MODALMESH_<DEST>`` when that variable is set.

    Switches (store_true) read 1/0, true/false, yes/no, on/off; anything else is an error naming
    the variable, as is a value the flag's type or choices reject. The environment is read at
    parse time, so ``--help`` shows the defaults the environment set.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        kwargs.setdefault("epilog", f"Every flag can also be set as {ENV_PREFIX}<FLAG> "
                                    f"(e.g. {ENV_PREFIX}PORT=50051).")
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        for action in self._actions:
            if not action.option_strings or action.dest == "help":
                continue
            raw = os.environ.get(env_name(action.dest))
            if raw is None:
                continue
            if isinstance(action, argparse._StoreTrueAction):
                value = raw.strip().lower()
                if value not in TRUE_WORDS | FALSE_WORDS:
                    self.error(f"{env_name(action.dest)}={raw!r}: expected 1/0, true/false, yes/no or on/off")
                action.default = value in TRUE_WORDS
            else:
                try:
                    action.default = action.type(raw) if action.type else raw
                except (TypeError, ValueError):
                    self.error(f"{env_name(action.dest)}={raw!r} is not a valid value for {action.option_strings[0]}")
                # argparse checks choices on the command line only, never on a default: check the env here.
                if action.choices is not None and action.default not in action.choices:
                    self.error(f"{env_name(action.dest)}={raw!r} is not a valid value for {action.option_strings[0]}"
                               f" (choose from {', '.join(map(str, action.choices))})")
        return super().parse_known_args(args, namespace)


def add_process_arguments(parser: argparse.ArgumentParser, *, port: int, protocol: str = "gRPC",
                          what: str = "calls") -> None:
    """The flags every server process has: where it listens, its metrics port, its drain, its log level.

    `protocol` names what `--port` speaks ("gRPC", "HTTP"); `what` names what the drain lets finish.
    """
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address the {protocol} and metrics servers bind "
                             "(0.0.0.0: every interface; containers set it)")
    parser.add_argument("--port", type=int, default=port, help=f"{protocol} port (0 picks a free one)")
    parser.add_argument("--metrics-port", type=int, default=9400, help="Prometheus port (0 picks one, -1 disables)")
    parser.add_argument("--metrics-buckets", default=None,
                        help="upper bounds in seconds, comma-separated, of the whole-request latency histograms "
                             "(e2e, queue, prefill, decode; the gateway's HTTP duration), e.g. 1,10,60,600,3600 "
                             "(default: 0.1 s to 4 h)")
    parser.add_argument("--grace-period", type=float, default=30.0,
                        help=f"seconds in-flight {what} get to finish on SIGTERM")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="log level")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text: one readable line per record; json: one JSON object per line (with the "
                             "request id where known), for log collectors")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://otel-collector:4317 "
                             "(needs pip install 'modalmesh[tracing]'; default: tracing off)")


def service_parser(service: str, description: str, *, max_message_mb: int = 64) -> argparse.ArgumentParser:
    """The flags of `python -m services.<service>`: the process flags (modalmesh.flags) and the model's."""
    parser = EnvArgumentParser(prog=f"python -m services.{service}", description=description)
    parser.add_argument("--model", type=str, default=None, help="checkpoint directory (Hugging Face / diffusers layout)")
    parser.add_argument("--model-id", type=str, default=None, help="name reported in Info (default: the directory name)")
    add_process_arguments(parser, port=50051)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                        help="weights and activations (auto: bfloat16 on CUDA, float32 on CPU, or the service's own)")
    parser.add_argument("--attention-backend", default=None, help="e.g. 'sdpa_math' or 'llm=fa3,vision_encoder=sdpa_cudnn'")
    parser.add_argument("--dummy-weights", action="store_true", help="random weights of the checkpoint's shapes")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="keep compiled kernels (Triton's and inductor's caches) in DIR, so a restart reads them "
                             "instead of compiling again (default: the libraries' own, ~/.triton and /tmp)")
    parser.add_argument("--max-message-mb", type=int, default=max_message_mb, help="largest gRPC message accepted/sent")
    parser.add_argument("--max-connection-age", type=float, default=300.0,
                        help="seconds before a client connection is asked to reconnect (load balancing); 0: never")
    parser.add_argument("--max-connection-age-grace", type=float, default=None,
                        help="seconds calls in flight on an aged connection may still run (default: unlimited)")
    from modalmesh.rpc.security import add_security_arguments  # grpc, not torch

    add_security_arguments(parser)
    parser.add_argument("--no-reflection", dest="reflection", action="store_false",
                        help="do not serve gRPC server reflection (it lists every method to anyone who connects)")
    parser.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                        help="keep the start-up heap (model, libraries) in Python's garbage collector: every full "
                             "collection then walks it with the GIL held (modalmesh_gc_pause_seconds)")
    return parser


def help_requested(argv: list[str] | None = None) -> bool:
    """Whether the command line asks for --help: a service's ``__main__`` then prints its flags from its
    flags module, before importing the model stack (torch takes seconds to import)."""
    import sys

    return any(arg in ("-h", "--help") for arg in (sys.argv[1:] if argv is None else argv))
