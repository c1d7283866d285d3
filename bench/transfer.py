"""Embedding transfer encoder -> LLM through the real services: GB/s by path, and its share of TTFT.

    python bench/transfer.py                 # the device is CUDA when there is one, else the CPU
    python bench/transfer.py --sizes 448 --repeat 5

Starts one vision encoder and two LLM services (one offering the same-host shared-memory path,
one told `--encoder-shared-memory off`) on a Qwen2-VL checkpoint whose layers are tiny but whose
embeddings are Qwen2-VL-7B-sized: rows x 3584 in bf16, so a 448x448 image gives 256 rows (1.8 MB)
and a 2688x2688 image 9216 rows (66 MB). For each image size:

- transfer: Encode of an image the encoder has already cached (no model work), to a tensor in
  the caller: through a plain client (the generated stub and protobuf: the peer), and through the
  LLM's own `EncoderPool` as message bytes and through shared memory (to the CPU), and, with
  CUDA, through CUDA IPC onto the GPU (and shared memory onto the GPU, for comparison);
  GB/s = embedding bytes / call time (median of --repeat calls).
- limit: one memcpy of the same bytes in this process.
- RPC floor: the same call for a cached 56x56 image (28 KB): what any Encode costs, whatever it
  carries; the same-host call's time beyond it is what the embedding's size costs.
- where a call's time goes (`--split`, beside each path): the LLM pool's own stages, the RPC (the encoder's
  handler within it) and the take (the read onto the caller's device), means over the same calls; the
  rest of the RPC beyond the handler is transport and both event loops.
- TTFT: Generate(image + text, one output token) on each LLM (same-host paths on: CUDA IPC on a
  GPU, shared memory on the CPU; and off), the image cached on the encoder, and the transfer's
  share of it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from prometheus_client import generate_latest  # noqa: E402

from bench import mean_ms_between, samples, scrape  # noqa: E402
from modalmesh import pb  # noqa: E402
from modalmesh.metrics import Metrics  # noqa: E402
from modalmesh.ops.launcher import ServiceProcess  # noqa: E402
from modalmesh.rpc.shm import ShmProbe, shm_available  # noqa: E402

HIDDEN = 3584  # Qwen2-VL-7B's LLM width: the width of every image embedding row
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
_WARMUP = 3


def make_checkpoint(out: Path) -> Path:
    """Tiny towers, Qwen2-VL-7B-wide embeddings (random weights, saved as transformers does)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from modalmesh.testing import tiny

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    tok = tiny._qwen_tokenizer()
    eot, im_end, vs, ve, img, vid = tiny._ids(tok, "<|endoftext|>", "<|im_end|>", "<|vision_start|>",
                                             "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    text = dict(vocab_size=tiny.VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=16384, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                bos_token_id=eot, eos_token_id=im_end)
    vision = dict(depth=1, embed_dim=32, hidden_size=HIDDEN, num_heads=2, mlp_ratio=1, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=img, video_token_id=vid,
                           vision_start_token_id=vs, vision_end_token_id=ve, tie_word_embeddings=False)
    model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=2688 * 2688)
    return tiny._save(model, tok, out, processor)


def smooth_png(side: int) -> bytes:
    """A gradient: a small upload, so the call time is the answer's (the embedding's)."""
    from PIL import Image

    ramp = np.linspace(0, 255, side, dtype=np.float32)
    pixels = np.stack([ramp[None, :].repeat(side, 0), ramp[:, None].repeat(side, 1),
                       np.full((side, side), 128, np.float32)], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def encoder_samples(metrics_port: int | None) -> list:
    """The encoder's samples now (none without its exporter)."""
    return [] if metrics_port is None else scrape(metrics_port)


async def time_encode(target: str, item: pb.EncodeItem, repeat: int, mode: str,
                      encoder_metrics_port: int | None = None) -> tuple[float, int, dict[str, float]]:
    """Median seconds of one cached Encode, the embedding's bytes, and where a call's time went (means, ms:
    rpc and take as the pool times them, the encoder's handler and its stages). `mode`: "stub" is a plain
    client (the generated stub, protobuf parsing, `from_proto`: the peer); "bytes" and "shm" are the LLM's own
    `EncoderPool` without and with the shared-memory offer."""
    from modalmesh.rpc.channel import aio_channel
    from modalmesh.rpc.codec import from_proto
    from services.llm.encoders import EncoderPool

    from modalmesh.rpc.transfer import path_of

    probe = ShmProbe() if mode in ("shm", "shm_gpu", "cuda_ipc") else None
    device = torch.device("cuda") if mode in ("shm_gpu", "cuda_ipc") else None
    metrics = Metrics("llm", process_metrics=False)
    pool = EncoderPool(pb.IMAGE, target, probe=probe, device=device, metrics=metrics)
    if mode == "shm_gpu":
        pool.receiver.cuda_ipc = False
    want = {"stub": "grpc", "bytes": "grpc", "shm": "shared_memory", "shm_gpu": "shared_memory"}.get(mode, mode)
    channel = aio_channel(target, max_message_bytes=256 << 20)
    stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
    def readings():  # the pool's own histograms (this process) and the encoder's
        return samples(generate_latest(metrics.registry).decode()), encoder_samples(encoder_metrics_port)

    try:
        times, nbytes = [], 0
        for i in range(repeat + _WARMUP):  # warm-up calls: the channel's windows, the slab, the mapping
            if i == _WARMUP:
                ours0, theirs0 = readings()
            start = time.perf_counter()
            if mode == "stub":
                reply = await stub.Encode(pb.EncodeRequest(items=[item]), timeout=600)
                tensor = from_proto(reply.embeddings[0].embedding)
            else:
                reply, tensor = await pool.encode_one(item, 0, timeout=600)
            times.append(time.perf_counter() - start)
            if path_of(reply.embeddings[0].embedding) != want:
                raise RuntimeError(f"{mode}: the answer took the {path_of(reply.embeddings[0].embedding)} path: "
                                   "is /dev/shm shared?")
            nbytes = tensor.numel() * tensor.element_size()
        ours, theirs = readings()
        split = {"rpc": mean_ms_between(ours0, ours, "modalmesh_encode_call_seconds", stage="rpc"),
                 "take": mean_ms_between(ours0, ours, "modalmesh_encode_call_seconds", stage="take"),
                 "handler": mean_ms_between(theirs0, theirs, "modalmesh_request_duration_seconds", rpc="Encode"),
                 **{stage: mean_ms_between(theirs0, theirs, "modalmesh_encode_stage_seconds", stage=stage)
                    for stage in ("prepare", "respond")}}
        return statistics.median(times[_WARMUP:]), nbytes, split
    finally:
        await pool.close()
        await channel.close()
        if probe is not None:
            probe.close()


def memcpy_seconds(nbytes: int, repeat: int) -> float:
    """One single-threaded memcpy (numpy's), as the transfer paths copy: torch's `copy_` goes through its
    intra-op pool, whose wake-ups dominated a few-MB copy on a busy host (0.2 GB/s measured)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def ttft(target: str, item: pb.EncodeItem, repeat: int) -> float:
    request = pb.GenerateRequest(text=f"{VISION} Describe.", sampling=pb.SamplingParams(temperature=0, max_tokens=1),
                                 items=[pb.MultimodalItem(modality=pb.IMAGE, input=item)])
    times = []
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20)]) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        for _ in range(repeat + 1):
            start = time.perf_counter()
            for reply in stub.Generate(request, timeout=600):
                if reply.token_ids:
                    times.append(time.perf_counter() - start)
                    break
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="448,2688", help="image sides in pixels (multiples of 28)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--ttft-repeat", type=int, default=3)
    parser.add_argument("--ttft-max-side", type=int, default=1 << 30,
                        help="skip TTFT for larger images (a CPU prefills 9k tokens slowly)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checkpoint", default=None, help="where to make (or find) the checkpoint")
    args = parser.parse_args()
    if not shm_available():
        print("no writable /dev/shm here: only the bytes path can be measured", file=sys.stderr)
        return 1
    ckpt = make_checkpoint(Path(args.checkpoint or Path(tempfile.gettempdir()) / "modalmesh-bench-transfer"))
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--model", str(ckpt),
              "--device", args.device, "--dtype", "bfloat16"]
    # The encoder exports its metrics: its handler's time and stages, beside the pool's split of each call.
    vision = ServiceProcess("vision_encoder", [*common, "--metrics-port", "0", "--cache-mb", "2048",
                                               "--max-batch-tokens", "65536"]).start()
    procs = [vision]
    try:
        vision.wait_listening(300)
        # No prefix cache: TTFT asks about the same image again and again, which the cache would not encode.
        llm_flags = [*common, "--vision-encoder", vision.target, "--kv-cache-tokens", "16384",
                     "--max-model-len", "12000", "--no-prefix-caching"]
        fast = ServiceProcess("llm", llm_flags).start()
        plain = ServiceProcess("llm", [*llm_flags, "--encoder-shared-memory", "off"]).start()
        procs += [fast, plain]
        for p in procs:
            p.wait_serving(timeout=900)
        # The cost of any Encode call, whatever its answer: a cached 56x56 image (4 rows, 28 KB) as bytes.
        def timed(item, mode):
            return asyncio.run(time_encode(vision.target, item, args.repeat, mode, vision.metrics_port))

        floor_s, _, floor_split = timed(pb.EncodeItem(data=smooth_png(56), max_pixels=56 * 56), "bytes")
        splits = {("56 (floor)", "bytes"): floor_split}
        rows = []
        nan = (float("nan"), 0, {})
        for side in (int(s) for s in args.sizes.split(",")):
            item = pb.EncodeItem(data=smooth_png(side), max_pixels=side * side)
            gpu = args.device == "cuda"
            (stub_s, nbytes, _), (grpc_s, _, grpc_split), (shm_s, _, shm_split) = (
                timed(item, "stub"), timed(item, "bytes"), timed(item, "shm"))
            ipc_s, _, ipc_split = timed(item, "cuda_ipc") if gpu else nan
            shm_gpu_s, _, shm_gpu_split = timed(item, "shm_gpu") if gpu else nan
            splits.update({(side, "bytes"): grpc_split, (side, "shared memory"): shm_split,
                           (side, "shm -> GPU"): shm_gpu_split, (side, "CUDA IPC"): ipc_split})
            copy_s = memcpy_seconds(nbytes, args.repeat)
            if side <= args.ttft_max_side:
                fast_ttft, plain_ttft = ttft(fast.target, item, args.ttft_repeat), ttft(plain.target, item, args.ttft_repeat)
            else:
                fast_ttft = plain_ttft = float("nan")
            rows.append(dict(side=side, rows=nbytes // (HIDDEN * 2), mb=nbytes / 1e6,
                             stub_ms=stub_s * 1e3, stub_gb_s=nbytes / stub_s / 1e9,
                             grpc_ms=grpc_s * 1e3, grpc_gb_s=nbytes / grpc_s / 1e9,
                             shm_ms=shm_s * 1e3, shm_gb_s=nbytes / shm_s / 1e9,
                             shm_gpu_ms=shm_gpu_s * 1e3, ipc_ms=ipc_s * 1e3, ipc_gb_s=nbytes / ipc_s / 1e9,
                             memcpy_gb_s=nbytes / copy_s / 1e9,
                             ttft_shm_ms=fast_ttft * 1e3, shm_share_of_ttft=(ipc_s if gpu else shm_s) / fast_ttft,
                             ttft_grpc_ms=plain_ttft * 1e3, grpc_share_of_ttft=grpc_s / plain_ttft,
                             rpc_floor_ms=floor_s * 1e3,
                             beyond_floor_share=((ipc_s if gpu else shm_s) - floor_s) / fast_ttft))
    except BaseException:
        for p in procs:  # the services' own account of an INTERNAL error
            print(f"--- {p.service} log (last 40 lines) ---\n" + "\n".join(list(p.lines)[-40:]), file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.terminate(timeout=60)
    print(json.dumps([{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows], indent=1))
    print(f"\ndevice {args.device}; one image's embedding (rows x {HIDDEN} bf16), encoder cache hit, median of "
          f"{args.repeat}")
    print(f"{'image':>10} {'MB':>6} | {'plain gRPC stub (peer)':>22} | {'ours: bytes':>19} | "
          f"{'ours: shared memory':>19} | {'shm -> GPU':>9} | {'CUDA IPC -> GPU':>19} | {'memcpy':>10} | {'TTFT same-host':>14} {'share':>6} | {'TTFT bytes':>10} {'share':>6} | "
          f"{'RPC floor':>9} {'beyond it':>9}")
    for r in rows:
        print(f"{r['side']:>5}x{r['side']:<4} {r['mb']:6.1f} | {r['stub_ms']:8.2f} ms {r['stub_gb_s']:5.2f} GB/s | "
              f"{r['grpc_ms']:6.2f} ms {r['grpc_gb_s']:5.2f} GB/s | {r['shm_ms']:6.2f} ms {r['shm_gb_s']:5.2f} GB/s | "
              f"{r['shm_gpu_ms']:6.2f} ms | {r['ipc_ms']:6.2f} ms {r['ipc_gb_s']:5.2f} GB/s | "
              f"{r['memcpy_gb_s']:5.1f} GB/s | {r['ttft_shm_ms']:11.1f} ms {r['shm_share_of_ttft']:6.1%} | "
              f"{r['ttft_grpc_ms']:7.1f} ms {r['grpc_share_of_ttft']:6.1%} | {r['rpc_floor_ms']:6.2f} ms "
              f"{r['beyond_floor_share']:9.1%}")
    print("RPC floor: the same Encode call for a cached 56x56 image (28 KB, bytes); 'beyond it': the same-host "
          "call's time above that floor, as a share of TTFT")
    print("\nwhere a call's time goes (means of the same calls, ms): the pool's rpc and take; within the rpc the "
          "encoder's handler (its prepare and respond stages); rpc - handler = transport and both event loops")
    print(f"{'image':>10} {'path':>14} | {'rpc':>6} {'take':>6} | {'handler':>7} {'prepare':>7} {'respond':>7} | "
          f"{'rpc-handler':>11}")
    for (side, path), sp in splits.items():
        if not sp:
            continue
        print(f"{side!s:>10} {path:>14} | {sp['rpc']:6.3f} {sp['take']:6.3f} | {sp['handler']:7.3f} "
              f"{sp['prepare']:7.3f} {sp['respond']:7.3f} | {sp['rpc'] - sp['handler']:11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
