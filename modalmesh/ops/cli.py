"""`modalmesh` command line: run the stack, probe health, query Info.

Every client command defaults to the same service in both layouts: 127.0.0.1:50051 is the LLM in
`modalmesh up` and in the compose stack (docker-compose.publish.yml), 127.0.0.1:50054 the VAE.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modalmesh import pb
from modalmesh.errors import ConfigError
from modalmesh.flags import DefaultsHelpFormatter
from modalmesh.ops import stack
from modalmesh.ops.stack import StackError
from modalmesh.rpc.channel import sync_channel
from modalmesh.rpc.security import Security, add_security_arguments

_INFO_STUBS = {
    "llm": (pb.llm_pb2_grpc.LLMServiceStub, pb.LLM_SERVICE),
    "encoder": (pb.encoder_pb2_grpc.EncoderServiceStub, pb.ENCODER_SERVICE),
    "vae": (pb.vae_pb2_grpc.VAEServiceStub, pb.VAE_SERVICE),
}


def health(args: argparse.Namespace) -> int:
    """Exit 0 when the target reports SERVING: the compose / k8s probe."""
    security = _security(args)
    with sync_channel(args.target, security=security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout,
                metadata=security.call_metadata())
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def info(args: argparse.Namespace) -> int:
    stub_cls, _ = _INFO_STUBS[args.kind]
    security = _security(args)
    with sync_channel(args.target, security=security) as channel:
        try:
            reply = stub_cls(channel).Info(pb.InfoRequest(), timeout=args.timeout, metadata=security.call_metadata())
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json_format.MessageToJson(reply, always_print_fields_with_no_presence=True))
    return 0


def _security(args: argparse.Namespace) -> Security:
    try:
        return Security.from_args(args)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SystemExit(f"cannot read {path}: {exc.strerror}") from None


def generate(args: argparse.Namespace) -> int:
    """Stream a completion; images and audio go as raw bytes for the LLM's encoder pools."""
    items = [pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=_read(p))) for p in args.image]
    items += [pb.MultimodalItem(modality=pb.AUDIO, input=pb.EncodeItem(data=_read(p))) for p in args.audio]
    sampling = pb.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    if args.seed is not None:
        sampling.seed = args.seed
    if args.raw:
        request = pb.GenerateRequest(text=args.prompt, items=items, sampling=sampling)
    else:
        parts = [pb.ContentPart(item=item) for item in items] + [pb.ContentPart(text=args.prompt)]
        request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=parts)]),
                                     sampling=sampling)
    security = _security(args)
    with sync_channel(args.target, security=security) as channel:
        try:
            for reply in pb.llm_pb2_grpc.LLMServiceStub(channel).Generate(request, timeout=args.timeout,
                                                                           metadata=security.call_metadata()):
                print(reply.text, end="", flush=True)
                if reply.finish_reason:
                    print(f"\n[{pb.FinishReason.Name(reply.finish_reason).lower()}: "
                          f"{reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens]",
                          file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"\n{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def load_latents(path: str):
    """Latents from a .safetensors file (its only tensor, or one named 'latents') or a .npy file."""
    import numpy as np
    import torch

    if path.endswith(".npy"):
        return torch.from_numpy(np.load(path, allow_pickle=False))
    from safetensors.torch import load_file

    tensors = load_file(path)
    if "latents" in tensors:
        return tensors["latents"]
    if len(tensors) != 1:
        raise SystemExit(f"{path}: holds {sorted(tensors)}; name the tensor 'latents'")
    return next(iter(tensors.values()))


def decode(args: argparse.Namespace) -> int:
    from modalmesh.rpc.codec import to_proto

    latents = load_latents(args.latents)
    if latents.dim() == 3:
        latents = latents.unsqueeze(0)
    request = pb.DecodeRequest(latents=to_proto(latents), output=pb.PNG, skip_scaling=args.skip_scaling)
    security = _security(args)
    with sync_channel(args.target, security=security) as channel:
        try:
            reply = pb.vae_pb2_grpc.VAEServiceStub(channel).Decode(request, timeout=args.timeout,
                                                                   metadata=security.call_metadata())
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    outputs = [args.output] if len(reply.png) == 1 else [
        args.output.replace(".png", f"-{i}.png") for i in range(len(reply.png))]
    for path, data in zip(outputs, reply.png):
        with open(path, "wb") as f:
            f.write(data)
        print(path)
    return 0


LLM_TARGET = "127.0.0.1:50051"  # the LLM under `modalmesh up` and as compose publishes it
VAE_TARGET = "127.0.0.1:50054"  # the VAE, likewise


def build_parser() -> argparse.ArgumentParser:
    formatter = DefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="modalmesh", description=__doc__, formatter_class=formatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=formatter)

    stack.add_up_arguments(command("up", "start the four services and the OpenAI gateway as local processes"))
    stack.add_serve_arguments(command("serve", "serve one checkpoint directory: the encoders it needs, the LLM and "
                                               "the OpenAI gateway as local processes"))
    p = command("demo", "start the stack, send an image, an audio and a latents request, stop")
    stack.add_up_arguments(p)
    p.add_argument("--out-dir", default=None, help="where the decoded PNG goes (default: a temporary folder)")
    p = command("health", "exit 0 if a service is SERVING (gRPC health)")
    add_security_arguments(p, server=False)
    p.add_argument("--target", default=LLM_TARGET, help="host:port of the service (the default is the LLM)")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    p = command("info", "print a service's Info as JSON")
    add_security_arguments(p, server=False)
    p.add_argument("--target", default=LLM_TARGET, help="host:port of the service (the default is the LLM)")
    p.add_argument("--kind", choices=sorted(_INFO_STUBS), default="llm", help="which service API the target speaks")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds")
    p = command("generate", "stream a completion from the LLM service")
    add_security_arguments(p, server=False)
    p.add_argument("prompt", help="the user message (or, with --raw, the whole prompt)")
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--audio", action="append", default=[], help="audio file: WAV, FLAC, OGG (repeatable)")
    p.add_argument("--target", default=LLM_TARGET, help="host:port of the LLM")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--raw", action="store_true", help="send the prompt as is (with placeholders), not as a chat")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds")
    p = command("decode", "decode latents to PNG through the VAE service")
    add_security_arguments(p, server=False)
    p.add_argument("latents", help=".safetensors or .npy file with (B, C, h, w) or (C, h, w) latents")
    p.add_argument("-o", "--output", default="out.png", help="PNG path (-0, -1, ... added for a batch)")
    p.add_argument("--target", default=VAE_TARGET, help="host:port of the VAE")
    p.add_argument("--skip-scaling", action="store_true", help="latents are already unscaled")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds")
    return parser


def demo(args: argparse.Namespace) -> int:
    from modalmesh.ops.demo import demo as run_demo  # torch, PIL: only when asked for

    return run_demo(args)


COMMANDS = {"up": stack.up, "serve": stack.serve, "demo": demo, "health": health, "info": info, "generate": generate,
            "decode": decode}


def main(argv=None) -> int:
    """Run one command; operator errors are one line on stderr, never a traceback."""
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except StackError as exc:
        print(f"modalmesh: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the stack is up (once up, `up` drains on it itself)
        print("modalmesh: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `modalmesh info | head`: the reader left; say nothing
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process killed by SIGPIPE, which is what a shell pipeline expects


if __name__ == "__main__":
    sys.exit(main())
