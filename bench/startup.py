"""Service start-up with and without the compile cache: seconds to SERVING on a first start (an empty
--compile-cache directory) and on the next one (the directory the first start filled: a restarted container
with the cache on a volume), beside diffusers' VAE under torch.compile started the same two ways.

    python bench/startup.py                  # on a GPU: the VAE (SDXL), SigLIP-so400m, Whisper-large-v3, the
                                             # LLM (Qwen2.5-7B shape), random weights; and the compiled peer
    python bench/startup.py --quick          # tiny checkpoints on the CPU (checks the script, not speed)
    python bench/startup.py --services vae --peer-modes default,max-autotune

Each start is a fresh process, timed from its launch. The VAE also gets one 1024² decode right after SERVING
("first decode"): a shape the warm-up did not run may still compile kernels of its own. The peer is diffusers'
AutoencoderKL (SDXL shape, channels-last, as its torch.compile recipe) in a fresh process: seconds from launch
to its first 1024² decode, with empty inductor and Triton caches, then with the ones that start filled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SERVICES = ("vae", "vision_encoder", "audio_encoder", "llm")


def checkpoint(service: str, quick: bool) -> tuple[Path, list[str]]:
    """A config-only checkpoint for `service` (it loads random weights) and the flags it is started with."""
    if service == "vae":
        from bench.vae import QUICK_VAE, SDXL_VAE

        root = Path(tempfile.mkdtemp(prefix="bench-startup-vae-"))
        (root / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL",
                                                      **(QUICK_VAE if quick else SDXL_VAE)}))
        return root, []
    if service == "vision_encoder":
        from bench.vision import hf_config, write_checkpoint

        cfg, proc = hf_config("siglip", quick)
        return write_checkpoint(cfg, proc, Path(tempfile.mkdtemp(prefix="bench-startup-siglip-"))), []
    if service == "audio_encoder":
        from bench.audio import LARGE_V3, QUICK, make_checkpoint

        return make_checkpoint(QUICK if quick else LARGE_V3), []
    from bench.llm import QUICK as LLM_QUICK
    from bench.llm import QWEN25_7B, make_checkpoint

    flags = ["--max-model-len", "4096"] + (["--kv-cache-tokens", "65536"] if quick else [])
    return make_checkpoint(LLM_QUICK if quick else QWEN25_7B), flags


def first_decode(target: str, side: int) -> float:
    """Seconds of one Decode of a (1, 4, side, side) latent, sent right after SERVING."""
    import grpc
    import torch

    from modalmesh import pb
    from modalmesh.rpc.codec import to_proto

    z = torch.randn(1, 4, side, side)
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20)]) as channel:
        stub = pb.vae_pb2_grpc.VAEServiceStub(channel)
        start = time.perf_counter()
        stub.Decode(pb.DecodeRequest(latents=to_proto(z), output=pb.TENSOR_UINT8, skip_scaling=True), timeout=600)
        return time.perf_counter() - start


def start_once(service: str, ckpt: Path, flags: list[str], cache: Path, quick: bool) -> tuple[float, float | None]:
    """(seconds from launch to SERVING, the VAE's first decode in seconds or None)."""
    from modalmesh.ops.launcher import ServiceProcess

    argv = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--model", str(ckpt), "--dummy-weights",
            "--compile-cache", str(cache), *flags, *(["--device", "cpu"] if quick else [])]
    start = time.perf_counter()
    with ServiceProcess(service, argv).start() as proc:
        proc.wait_serving(timeout=600)
        serving = time.perf_counter() - start
        decode = first_decode(proc.target, 16 if quick else 128) if service == "vae" else None
        proc.terminate()
    return serving, decode


PEER_CHILD = """
import sys, time
launched = float(sys.argv[1])
import torch
from diffusers import AutoencoderKL
sys.path.insert(0, sys.argv[3])
from bench.vae import QUICK_VAE, SDXL_VAE
quick = sys.argv[4] == "1"
device = torch.device("cpu" if quick else "cuda")
vae = AutoencoderKL(**(QUICK_VAE if quick else SDXL_VAE)).to(device, torch.bfloat16).eval().requires_grad_(False)
vae.to(memory_format=torch.channels_last)
decode = torch.compile(vae.decode, mode=sys.argv[2])
side = 16 if quick else 128
z = torch.randn(1, 4, side, side, device=device, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
with torch.no_grad():
    decode(z).sample.float().sum().item()
print(time.time() - launched)
"""


def peer_once(mode: str, cache: Path, quick: bool) -> float:
    """Seconds from launching a process to its first compiled decode, with inductor's and Triton's caches in
    `cache`."""
    from modalmesh.compile_cache import CompileCache

    env = {**os.environ, **CompileCache(cache).environment()}  # where --compile-cache puts them
    out = subprocess.run([sys.executable, "-c", PEER_CHILD, str(time.time()), mode,
                          str(Path(__file__).resolve().parents[1]), "1" if quick else "0"],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", default=",".join(SERVICES), help=f"any of {', '.join(SERVICES)}")
    parser.add_argument("--peer-modes", default="default", help="torch.compile modes of the peer ('' skips it)")
    parser.add_argument("--quick", action="store_true", help="tiny checkpoints on the CPU")
    args = parser.parse_args(argv)
    from modalmesh.compile_cache import CompileCache

    # The first start would otherwise also read torch & co. from a cold disk: every start below finds them cached.
    subprocess.run([sys.executable, "-c", "import torch, transformers, grpc, diffusers"], check=True, timeout=300)
    made: list[Path] = []

    print("| start | first (empty cache) s | next (cache filled) s | saved s | first 1024² decode s, first / next "
          "| cache files | cache MB |")
    print("|---|---|---|---|---|---|---|")
    for service in [s for s in args.services.split(",") if s]:
        ckpt, flags = checkpoint(service, args.quick)
        cache = Path(tempfile.mkdtemp(prefix=f"bench-startup-cache-{service}-"))
        made += [ckpt, cache]
        try:
            cold, cold_decode = start_once(service, ckpt, flags, cache, args.quick)
            files, size = CompileCache(cache).entries()
            warm, warm_decode = start_once(service, ckpt, flags, cache, args.quick)
        except Exception as exc:  # noqa: BLE001 - one service failing to start still leaves the others' rows
            print(f"| {service} | failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]} | | | | | |",
                  flush=True)
            continue
        decodes = f"{cold_decode:.2f} / {warm_decode:.2f}" if cold_decode is not None else "-"
        print(f"| ours: {service} | {cold:.1f} | {warm:.1f} | {cold - warm:.1f} | {decodes} | {files} | "
              f"{size / 1e6:.1f} |", flush=True)
    for mode in [m for m in args.peer_modes.split(",") if m]:
        cache = Path(tempfile.mkdtemp(prefix="bench-startup-peer-"))
        made.append(cache)
        try:
            cold = peer_once(mode, cache, args.quick)
            files, size = CompileCache(cache).entries()
            warm = peer_once(mode, cache, args.quick)
        except Exception as exc:  # noqa: BLE001 - no compiler, no Triton: say why
            print(f"| peer: diffusers VAE, torch.compile {mode} | failed: {exc} | | | | | |", flush=True)
            continue
        print(f"| peer: diffusers VAE, torch.compile {mode}, NHWC (launch to first decode) | {cold:.1f} | {warm:.1f} | "
              f"{cold - warm:.1f} | (in the start) | {files} | {size / 1e6:.1f} |", flush=True)
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
