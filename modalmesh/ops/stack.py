"""The stack on local processes: start the services and the gateway, wait for health, drain on Ctrl-C.

Each service gets the same flags the compose file gives its container; only the
ports differ (one machine). ``python -m modalmesh.ops.stack up`` == ``modalmesh up``.
``modalmesh serve DIR`` is the one-checkpoint form: the encoders DIR needs, the LLM and
the gateway, all on DIR, and the OpenAI base URL printed (as ``vllm serve DIR``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shlex
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from modalmesh.ops.launcher import GatewayProcess, ServiceProcess

# Port order: base (50051) is the LLM, as the compose stack publishes it, and base+3 (50054) the
# VAE, as compose does too; so `modalmesh info|health|generate` (50051) and `decode` (50054) find
# the same service under both layouts with no --target.
SERVICES = ("llm", "vision_encoder", "audio_encoder", "vae")
# No checkpoint the LLM serves takes both images and audio: a second LLM, on an audio checkpoint and fed by the
# audio encoder, takes the audio (gRPC base+4). The gateway serves both models, each by its own model id.
AUDIO_LLM = "audio_llm"
MODEL_SERVICES = (*SERVICES, AUDIO_LLM)
GATEWAY = "gateway"  # the OpenAI HTTP gateway, in front of the LLMs (and the VAE); metrics port base+5
MEMBERS = (*MODEL_SERVICES, GATEWAY)
GATEWAY_PORT = 8000
LLMS = ("llm", AUDIO_LLM)


class StackError(Exception):
    """The stack cannot start; the message is one line for the operator (the CLI prints it)."""


@dataclass
class StackMember:
    service: str
    process: ServiceProcess


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address every service binds")
    parser.add_argument("--base-port", type=int, default=50051,
                        help=f"gRPC ports: base, base+1, ... in the order {', '.join(MODEL_SERVICES)} "
                             "(0: any free port)")
    parser.add_argument("--metrics-base-port", type=int, default=9401,
                        help="metrics ports: base, base+1, ... in the same order (0: any free port)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the models run")
    parser.add_argument("--gateway-port", type=int, default=None,
                        help=f"the gateway's HTTP port (default {GATEWAY_PORT}, or any free port with --base-port 0)")
    parser.add_argument("--services", default=",".join(MEMBERS), help="comma-separated subset to start")
    for service in MODEL_SERVICES:
        parser.add_argument(f"--{service.replace('_', '-')}-model", default=None, metavar="DIR",
                            help=f"checkpoint directory for {service}")
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "modalmesh" / "tiny"),
                        help="where default tiny checkpoints are made (once) for services given no model")
    parser.add_argument("--no-default-models", action="store_true",
                        help="start services given no model without one (health and Info only)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each service gets to be SERVING")
    parser.add_argument("--verbose", action="store_true", help="echo the services' logs")


DEFAULT_MODELS = {"llm": "qwen2_vl", "vision_encoder": "qwen2_vl", "audio_encoder": "qwen2_audio", "vae": "vae",
                  AUDIO_LLM: "qwen2_audio"}


# Modules the tiny checkpoint makers need beyond the install requirements: the [demo] extra.
DEMO_EXTRA_MODULES = {"vae": "diffusers"}


def default_checkpoints(root: Path, services: list[str]) -> dict[str, Path]:
    """Tiny random checkpoints (made once, then reused from `root`) for services given no --*-model."""
    missing = sorted({DEMO_EXTRA_MODULES[s] for s in services if s in DEMO_EXTRA_MODULES
                      and not (root / DEFAULT_MODELS[s] / ".modalmesh-tiny").exists()
                      and importlib.util.find_spec(DEMO_EXTRA_MODULES[s]) is None})
    if missing:
        flags = " ".join(f"--{s.replace('_', '-')}-model DIR" for s in services if s in DEMO_EXTRA_MODULES)
        raise StackError(f"the default tiny checkpoints need {', '.join(missing)}, which is not installed: "
                         f"pip install 'modalmesh[demo]' (or pass {flags}, or --no-default-models)")
    from modalmesh.testing import tiny

    print(f"creating / reusing tiny random default checkpoints under {root}\n"
          "  (their outputs are meaningless: pass --llm-model DIR etc. to serve real checkpoints)", flush=True)
    return {s: tiny.ensure(DEFAULT_MODELS[s], root) for s in services}


def check_ports_free(host: str, ports: dict[int, tuple[str, str]]) -> None:
    """A StackError naming the first port already taken (another `modalmesh up`, say), before anything starts."""
    for port, (what, flag) in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            # As the services bind: SO_REUSEADDR, so a closed socket in TIME_WAIT does not count as taken.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise StackError(f"port {port} ({what}) on {host} is not free ({exc.strerror}), e.g. another "
                                 f"`modalmesh up` runs: stop it, or choose other ports with {flag} "
                                 f"(0: any free port)") from None


def gateway_port(args: argparse.Namespace) -> int:
    if args.gateway_port is not None:
        return args.gateway_port
    return GATEWAY_PORT if args.base_port else 0  # --base-port 0 (tests, a second stack): every port free


def _planned_ports(args: argparse.Namespace, order: list[str]) -> dict[int, tuple[str, str]]:
    """{port: (what, flag)} for every fixed port the stack will bind."""
    ports = {}
    for service in order:
        i = MEMBERS.index(service)
        if service == GATEWAY:
            if gateway_port(args):
                ports[gateway_port(args)] = ("HTTP of the gateway", "--gateway-port")
        elif args.base_port:
            ports[args.base_port + i] = (f"gRPC of {service}", "--base-port")
        if args.metrics_base_port:
            ports[args.metrics_base_port + i] = (f"metrics of {service}", "--metrics-base-port")
    return ports


def start_stack(args: argparse.Namespace) -> list[StackMember]:
    wanted = [s.strip() for s in args.services.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(MEMBERS))
    if unknown:
        raise StackError(f"unknown service(s) {unknown}; choose from {list(MEMBERS)}")
    if GATEWAY in wanted and not {"llm", AUDIO_LLM, "vae"} & set(wanted):
        raise StackError("the gateway needs an llm or the vae in --services")
    order = [s for s in MEMBERS if s in wanted]
    check_ports_free(args.host, _planned_ports(args, order))
    missing = [s for s in MODEL_SERVICES if s in wanted and not getattr(args, f"{s}_model")]  # the gateway has none
    defaults = default_checkpoints(Path(args.models_dir), missing) if missing and not args.no_default_models else {}
    members: list[StackMember] = []
    with _all_or_none(members):
        _start_members(args, order, defaults, members)
        wait_all_serving(members, args.host, args.startup_timeout)
    return members



@contextlib.contextmanager
def _all_or_none(members: list[StackMember]):
    """Start-up of `members`: on any failure (Ctrl-C included) nothing started is left running, and a
    member that said why it failed is named in the StackError."""
    try:
        yield
    except BaseException as exc:
        stop_stack(members)
        failed = next((m for m in members if m.process.error_line()), None)
        if failed is not None and isinstance(exc, (RuntimeError, TimeoutError)):
            raise StackError(f"{failed.service}: {failed.process.error_line()}") from None
        raise

def wait_all_serving(members: list[StackMember], host: str, timeout: float) -> None:
    for member in members:
        member.process.wait_serving(timeout=timeout, host=_local(host))


def _local(host: str) -> str:
    return "127.0.0.1" if host == "0.0.0.0" else host


def _start_members(args: argparse.Namespace, order: list[str], defaults: dict[str, Path],
                   members: list[StackMember]) -> None:
    host = _local(args.host)
    # Encoders and the VAE first: the LLM is started pointing at the encoders' bound ports, the gateway last
    # at the LLM's and the VAE's.
    for service in sorted(order, key=lambda s: (s == GATEWAY, s in LLMS)):
        i = MEMBERS.index(service)
        metrics_port = args.metrics_base_port + i if args.metrics_base_port else 0
        if service == GATEWAY:
            targets = {}
            for member in members:
                if member.service in (*LLMS, "vae"):
                    grpc_port, _ = member.process.wait_listening(timeout=args.startup_timeout)
                    targets[member.service] = f"{host}:{grpc_port}"
            llms = [targets[name] for name in LLMS if name in targets]  # the first serves requests naming no model
            flags = ["--host", args.host, "--port", str(gateway_port(args)), "--metrics-port", str(metrics_port)]
            flags += ["--llm", llms[0]] if llms else []
            flags += ["--more-llms", ";".join(llms[1:])] if llms[1:] else []
            flags += ["--vae", targets["vae"]] if "vae" in targets else []
            members.append(StackMember(service, GatewayProcess(flags, echo=args.verbose).start()))
            continue
        port = args.base_port + i if args.base_port else 0
        flags = ["--host", args.host, "--port", str(port), "--metrics-port", str(metrics_port), "--device", args.device]
        model = getattr(args, f"{service}_model") or defaults.get(service)
        if model:
            flags += ["--model", str(model)]
        if service in LLMS:
            # The image LLM gets the vision encoder (and the audio one, which it refuses to use unless its
            # checkpoint takes audio), the audio LLM the audio encoder.
            feeds = ("vision_encoder", "audio_encoder") if service == "llm" else ("audio_encoder",)
            for member in members:
                if member.service in feeds:
                    grpc_port, _ = member.process.wait_listening(timeout=args.startup_timeout)
                    flags += [f"--{member.service.replace('_', '-')}", f"ipv4:{host}:{grpc_port}"]
        module = "services.llm" if service == AUDIO_LLM else None
        members.append(StackMember(service, ServiceProcess(service, flags, echo=args.verbose, module=module).start()))
    members.sort(key=lambda m: MEMBERS.index(m.service))


def stop_stack(members: list[StackMember], timeout: float = 60.0) -> dict[str, int]:
    """Drain every service (SIGTERM to all at once), return their exit codes."""
    for member in members:
        member.process.send_sigterm()
    return {m.service: m.process.terminate(timeout) for m in members}


def print_endpoints(members: list[StackMember], host: str) -> None:
    shown = _local(host)
    print(f"{'service':<16}{'gRPC':<24}metrics")
    for m in members:
        if m.service == GATEWAY:  # HTTP, not gRPC: its own line below
            continue
        print(f"{m.service:<16}{shown + ':' + str(m.process.grpc_port):<24}"
              f"http://{shown}:{m.process.metrics_port}/metrics")
    for m in members:
        if m.service == GATEWAY:
            print(f"OpenAI API: http://{shown}:{m.process.grpc_port}/v1  "
                  f"(metrics http://{shown}:{m.process.metrics_port}/metrics)")
    sys.stdout.flush()


def supervise(members: list[StackMember]) -> int:
    """Until Ctrl-C / SIGTERM: then drain everything. A member that dies takes the rest down (exit 1)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        if any(m.process.proc.poll() is not None for m in members):
            dead = [m.service for m in members if m.process.proc.poll() is not None]
            print(f"service(s) exited unexpectedly: {dead}", file=sys.stderr)
            for m in members:
                if m.service in dead:
                    print(m.process.log_tail(), file=sys.stderr)
            stop_stack(members)
            return 1
        stop.wait(1.0)
    codes = stop_stack(members)
    print("stopped: " + ", ".join(f"{s}={c}" for s, c in codes.items()), flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


def up(args: argparse.Namespace) -> int:
    members = start_stack(args)
    print_endpoints(members, args.host)
    print("all services SERVING; Ctrl-C drains and stops them", flush=True)
    return supervise(members)


# ---- modalmesh serve DIR ------------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="DIR", help="checkpoint directory (Hugging Face layout)")
    parser.add_argument("--host", default="127.0.0.1", help="address every process binds")
    parser.add_argument("--port", type=int, default=GATEWAY_PORT, help="the OpenAI HTTP port (0: any free port)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the models run")
    parser.add_argument("--chat-template", default=None, metavar="FILE", help="the LLM's --chat-template")
    parser.add_argument("--max-model-len", type=int, default=None, help="the LLM's --max-model-len")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: DIR's name)")
    parser.add_argument("--llm-args", default="", metavar="FLAGS",
                        help="more LLM flags, one shell-quoted string (python -m services.llm --help)")
    parser.add_argument("--encoder-args", default="", metavar="FLAGS", help="more flags for each encoder")
    parser.add_argument("--gateway-args", default="", metavar="FLAGS",
                        help="more gateway flags, e.g. '--allowed-media-domains images.example.com'")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each process gets to be ready")
    parser.add_argument("--verbose", action="store_true", help="echo the processes' logs")


def encoders_for(model_dir: Path) -> list[str]:
    """The encoder services a checkpoint's LLM needs: one per modality its config has a placeholder token for."""
    from modalmesh.config import ModelConfig  # torch: only for serve
    from modalmesh.errors import ConfigError

    try:
        cfg = ModelConfig.from_hf(model_dir)
    except (ConfigError, OSError, ValueError) as exc:
        raise StackError(f"{model_dir}: not a checkpoint this stack serves ({exc})") from None
    return [name for name, token in (("vision_encoder", cfg.image_token_id), ("audio_encoder", cfg.audio_token_id))
            if token is not None]


def _split(flags: str, what: str) -> list[str]:
    try:
        return shlex.split(flags)
    except ValueError as exc:
        raise StackError(f"{what}: {exc}") from None


def start_serve(args: argparse.Namespace) -> list[StackMember]:
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise StackError(f"{model}: no config.json (give a checkpoint directory)")
    encoders = encoders_for(model)
    extra = {"llm": _split(args.llm_args, "--llm-args"), "encoder": _split(args.encoder_args, "--encoder-args"),
             "gateway": _split(args.gateway_args, "--gateway-args")}
    if args.port:
        check_ports_free(args.host, {args.port: ("HTTP of the gateway", "--port")})
    host = _local(args.host)
    common = ["--host", args.host, "--port", "0", "--metrics-port", "0", "--device", args.device, "--model", str(model)]
    members: list[StackMember] = []
    with _all_or_none(members):
        for name in encoders:
            members.append(StackMember(name, ServiceProcess(name, [*common, *extra["encoder"]],
                                                            echo=args.verbose).start()))
        llm_flags = [*common]
        for member in members:
            grpc_port, _ = member.process.wait_listening(timeout=args.startup_timeout)
            llm_flags += [f"--{member.service.replace('_', '-')}", f"ipv4:{host}:{grpc_port}"]
        if args.chat_template:
            llm_flags += ["--chat-template", str(Path(args.chat_template).resolve())]
        if args.max_model_len:
            llm_flags += ["--max-model-len", str(args.max_model_len)]
        llm = ServiceProcess("llm", [*llm_flags, *extra["llm"]], echo=args.verbose).start()
        members.append(StackMember("llm", llm))
        grpc_port, _ = llm.wait_listening(timeout=args.startup_timeout)
        gateway_flags = ["--host", args.host, "--port", str(args.port), "--metrics-port", "0",
                         "--llm", f"{host}:{grpc_port}"]
        if args.served_model_name:
            gateway_flags += ["--served-model-name", args.served_model_name]
        members.append(StackMember(GATEWAY, GatewayProcess([*gateway_flags, *extra["gateway"]],
                                                           echo=args.verbose).start()))
        wait_all_serving(members, args.host, args.startup_timeout)
    return members


def serve(args: argparse.Namespace) -> int:
    members = start_serve(args)
    print_endpoints(members, args.host)
    print(f"serving {args.model} ({', '.join(m.service for m in members)}); Ctrl-C drains and stops them",
          flush=True)
    return supervise(members)


def main(argv=None) -> int:
    from modalmesh.ops.cli import main as cli_main

    return cli_main(argv)  # `python -m modalmesh.ops.stack up ...` == `modalmesh up ...`


if __name__ == "__main__":
    sys.exit(main())
