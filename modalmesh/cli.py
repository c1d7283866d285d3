"""`modalmesh` command line: run the stack, probe health, query Info."""

from __future__ import annotations

import argparse
import sys

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modalmesh import pb, stack
from modalmesh.rpc.channel import sync_channel

_INFO_STUBS = {
    "llm": (pb.llm_pb2_grpc.LLMServiceStub, pb.LLM_SERVICE),
    "encoder": (pb.encoder_pb2_grpc.EncoderServiceStub, pb.ENCODER_SERVICE),
    "vae": (pb.vae_pb2_grpc.VAEServiceStub, pb.VAE_SERVICE),
}


def health(args: argparse.Namespace) -> int:
    """Exit 0 when the target reports SERVING: the compose / k8s probe."""
    with sync_channel(args.target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def info(args: argparse.Namespace) -> int:
    stub_cls, _ = _INFO_STUBS[args.kind]
    with sync_channel(args.target) as channel:
        try:
            reply = stub_cls(channel).Info(pb.InfoRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json_format.MessageToJson(reply, always_print_fields_with_no_presence=True))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="modalmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    stack.add_up_arguments(sub.add_parser("up", help="start the four services as local processes"))
    p = sub.add_parser("health", help="exit 0 if a service is SERVING (gRPC health)")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=5.0)
    p = sub.add_parser("info", help="print a service's Info as JSON")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--kind", choices=sorted(_INFO_STUBS), default="llm", help="which service API the target speaks")
    p.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.command == "up":
        return stack.up(args)
    if args.command == "health":
        return health(args)
    return info(args)


if __name__ == "__main__":
    sys.exit(main())
