"""Encoder services under load: N concurrent clients driving the real gRPC `Encode`, beside the tower alone.

    python bench/encode_load.py                        # on a GPU: real shapes, bf16, random weights
    python bench/encode_load.py --only siglip --clients 64
    python bench/encode_load.py --quick                # tiny shapes on the CPU (checks the script, not speed)

Cases (the issue's targets through the service on one H200):
  siglip     SigLIP-so400m-patch14-384, 512x384 JPEGs (resized to 384^2)       >= 500 img/s
  qwen2vl    Qwen2-VL-7B vision tower, 448x448 JPEGs                           >= 160 img/s
  whisper    Whisper-large-v3 encoder, 30 s WAV clips at 16 kHz                >= 140 clips/s

For each case the bench first times the tower alone, in this process: one batch (SigLIP 32,
Qwen2-VL 8, Whisper 16) prepared and encoded once, the tower's own inputs caught on the device
with a forward pre-hook, then the tower forward replayed on them (CUDA events, median). Then it
starts the encoder service (`--dummy-weights`, its own process, the same GPU) and drives it the
way the LLM does: every item its own Encode call, through the LLM's own encoder client
(`services.llm.encoders.EncoderPool`) with the same-host transfer offered, and every embedding
copied onto this process's GPU (where an LLM would splice it). Each request carries different
content, so the embedding cache never answers. Printed: items/s through the service, latency
p50/p99, the service's mean batch size, beside the tower-only items/s and the target.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench import percentile  # noqa: E402
from modalmesh import pb  # noqa: E402
from modalmesh.ops.launcher import ServiceProcess  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    service: str  # "vision_encoder" | "audio_encoder"
    unit: str
    tower_batch: int
    requests: int
    target: float  # items/s through the service (the issue's)


# Requests: enough for the 64 clients' closed loop to run many rounds at full load. With 384 Whisper calls
# (6 rounds) the ramp and the tail, at partial load, weighed: 133.7 clips/s against 151.0 with 1,024, the
# same code on the H200.
CASES = {
    "siglip": Case("siglip", "vision_encoder", "img", 32, 2048, 500.0),
    "qwen2vl": Case("qwen2vl", "vision_encoder", "img", 8, 768, 160.0),
    "whisper": Case("whisper", "audio_encoder", "clip", 16, 1024, 140.0),
}


# ---- checkpoints (configs only: the services load random weights with --dummy-weights) ---------------


def checkpoint(case: Case, quick: bool) -> Path:
    if case.name == "whisper":
        from bench.audio import LARGE_V3, QUICK, make_checkpoint

        return make_checkpoint(QUICK if quick else LARGE_V3)
    from bench.vision import hf_config, write_checkpoint

    cfg, proc = hf_config("siglip" if case.name == "siglip" else "qwen2_vl", quick)
    return write_checkpoint(cfg, proc, Path(tempfile.mkdtemp(prefix=f"bench-encode-{case.name}-")))


# ---- inputs: different content per request ---------------------------------------------------------


def jpeg(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG: smooth colour fields plus grain (random noise alone compresses badly)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    pixels = np.asarray(base, dtype=np.int16) + rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def wav(seconds: float, rate: int, seed: int) -> bytes:
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t) + 0.05 * rng.standard_normal(t.shape)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def items(case: Case, n: int, quick: bool) -> list[pb.EncodeItem]:
    if case.name == "whisper":
        return [pb.EncodeItem(data=wav(3.0 if quick else 30.0, 16000, i)) for i in range(n)]
    if case.name == "siglip":
        size = (80, 60) if quick else (512, 384)
    else:
        size = (112, 112) if quick else (448, 448)
    return [pb.EncodeItem(data=jpeg(*size, i)) for i in range(n)]


# ---- the tower alone -------------------------------------------------------------------------------


def tower_only(case: Case, ckpt: Path, device: torch.device, dtype: torch.dtype, iters: int,
               work: list[pb.EncodeItem]) -> float:
    """Items/s of the tower forward on device-resident inputs (what `encode` hands the tower)."""
    if case.service == "audio_encoder":
        from services.audio_encoder.model import build_encoder_model
    else:
        from services.vision_encoder.model import build_encoder_model
    # Eager: the tower's own forward is what is timed (the service replays it from CUDA graphs).
    model = build_encoder_model(ckpt, device=device, dtype=dtype, dummy=True, options={"cuda_graphs": False})
    tower = getattr(model, "tower", None) or model.module
    caught = {}

    def catch(module, args, kwargs):
        caught["args"], caught["kwargs"] = args, kwargs

    handle = tower.register_forward_pre_hook(catch, with_kwargs=True)
    batch = [model.prepare(item, i) for i, item in enumerate(work[:case.tower_batch])]
    model.encode(batch)
    handle.remove()

    def forward():
        with torch.inference_mode():
            tower(*caught["args"], **caught["kwargs"])

    from bench.vision import timed

    return case.tower_batch / timed(forward, iters, device) * 1e3  # the model goes with this frame


# ---- the service under load ------------------------------------------------------------------------


async def drive(target: str, modality: int, work: list[pb.EncodeItem], clients: int, device, *,
                service_pids: list[int], readings, distinct: int = 0) -> dict:
    """`distinct` > 0: only the first `distinct` items, over and over (after the warm-up round, every call
    is an encoder cache hit: the RPC and transfer path without the model). The service's threads' CPU use
    is sampled over the load beside this process's; `readings` is called with no argument just before
    and just after the timed load (the service's metrics then)."""
    from modalmesh.rpc.shm import ShmProbe, ShmReader, shm_available
    from services.llm.encoders import EncoderPool

    probe = ShmProbe() if shm_available() else None
    pool = EncoderPool(modality, target, probe=probe, reader=ShmReader() if probe else None, device=device)
    latencies: list[float] = []
    # The client's own split of a call: the RPC (the service, the transport both ways, both event loops)
    # and reading the embedding onto this process's device (EmbeddingReceiver.take).
    parts: dict[str, list[float]] = {"rpc": [], "take": []}

    def timing(part, call):
        async def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await call(*args, **kwargs)
            finally:
                parts[part].append(time.perf_counter() - start)
        return timed

    pool._encode, pool.receiver.take = timing("rpc", pool._encode), timing("take", pool.receiver.take)
    warm = min(clients, 4)
    next_item = iter(range(warm))  # the clients share one iterator: each takes the next item
    which = (lambda i: i % distinct) if distinct else (lambda i: i)

    async def client():
        for i in next_item:
            start = time.perf_counter()
            _reply, tensor = await pool.encode_one(work[which(i)], i, timeout=600)
            if tensor is None:
                raise RuntimeError("the encoder answered with no embedding")
            latencies.append(time.perf_counter() - start)

    try:
        await asyncio.gather(*(client() for _ in range(warm)))  # warm: channel, kernels, allocator
        if distinct:
            next_item = iter(range(distinct))
            await asyncio.gather(*(client() for _ in range(warm)))  # into the encoder's cache
        latencies.clear()
        for times in parts.values():
            times.clear()
        next_item = iter(range(warm, len(work)))
        before = readings()
        sampler = ThreadCpu([os.getpid(), *service_pids])
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
        busiest = sampler.busiest()
        after = readings()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        await pool.close()
        if probe is not None:
            probe.close()
    if not latencies:
        raise SystemExit(f"--requests {len(work)}: nothing left to time after the {warm} warm-up calls")
    return dict(items_s=len(latencies) / wall, mean_ms=statistics.mean(latencies) * 1e3,
                p50_ms=percentile(latencies, 50) * 1e3,
                p99_ms=percentile(latencies, 99) * 1e3, wall_s=wall, busiest_threads=busiest,
                client_ms={part: round(statistics.mean(times) * 1e3, 2) for part, times in parts.items() if times},
                readings=(before, after))


class ThreadCpu:
    """CPU use of every thread of some processes between its making and `busiest()` (Linux /proc)."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.start, self.t0 = self._read(), time.perf_counter()

    def _read(self) -> dict[tuple[int, int], tuple[str, int]]:
        out = {}
        for pid in self.pids:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    stat = task.joinpath("stat").read_text()
                except OSError:
                    continue
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                out[(pid, int(task.name))] = (name, int(fields[11]) + int(fields[12]))  # utime + stime
        return out

    def busiest(self, n: int = 8) -> list[str]:
        """Each process's CPU in all, then the `n` busiest threads, as "pid/name: percent of one core"."""
        end, wall = self._read(), time.perf_counter() - self.t0
        tick = os.sysconf("SC_CLK_TCK")
        use = [(ticks - self.start.get(key, (name, 0))[1], key[0], name) for key, (name, ticks) in end.items()]
        totals = [f"{pid} in all: {100 * sum(t for t, p, _ in use if p == pid) / tick / wall:.0f}% over "
                  f"{sum(p == pid for _, p, _ in use)} threads" for pid in self.pids]
        return totals + [f"{pid}/{name}: {100 * t / tick / wall:.0f}%" for t, pid, name in sorted(use, reverse=True)[:n]]


STAGES = ("prepare", "batch", "device", "respond")
PHASES = ("launch", "wait", "idle", "device")  # of the worker's batches (modalmesh_encoder_batch_seconds)


def service_sums(procs: list[ServiceProcess]) -> dict[tuple[str, str], float]:
    """(name, stage) -> value so far, for the _sum and _count of the services' batch sizes, Encode stages
    and Encode call time (summed over the replicas)."""
    sums: dict[tuple[str, str], float] = {}
    for proc in procs:
        _add_sums(sums, urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics",
                                               timeout=10).read().decode())
    return sums


def _add_sums(sums: dict[tuple[str, str], float], body: str) -> None:
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if not s.name.endswith(("_sum", "_count")):
                continue
            if s.name.startswith(("modalmesh_batch_size_", "modalmesh_encode_stage_seconds_",
                                  "modalmesh_encoder_batch_seconds_")) or (
                    s.name.startswith("modalmesh_request_duration_seconds_")
                    and s.labels.get("rpc", "").endswith("Encode")):
                key = (s.name, s.labels.get("stage", s.labels.get("phase", "")))
                sums[key] = sums.get(key, 0.0) + s.value


def delta(before: dict, after: dict, sample: str, label: str = "") -> float:
    """How much a `service_sums` value grew between two readings."""
    return after.get((sample, label), 0.0) - before.get((sample, label), 0.0)


def mean_between(before: dict, after: dict, histogram: str, label: str = "") -> float:
    """The mean of what `histogram` observed between two `service_sums` readings."""
    count = delta(before, after, histogram + "_count", label)
    return delta(before, after, histogram + "_sum", label) / count if count else float("nan")


def run_case(case: Case, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per variant: the same inputs through a service started afresh with each variant's flags (a
    service kept from the variant before would answer some of them from its embedding cache)."""
    ckpt = checkpoint(case, args.quick)
    n = args.requests or (48 if args.quick else case.requests)
    t0 = time.perf_counter()
    work = items(case, max(n, case.tower_batch), args.quick)
    make_inputs_s = time.perf_counter() - t0
    tower = float("nan") if args.no_tower else tower_only(case, ckpt, device, dtype, args.iters, work)
    work = work[:n]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the service below gets the GPU's memory back
    modality = pb.AUDIO if case.service == "audio_encoder" else pb.IMAGE
    rows, procs = [], []
    try:
        for name, extra in args.variants:
            row = {"case": case.name, "variant": name, "unit": case.unit, "target": case.target,
                   "tower_items_s": tower, "make_inputs_s": make_inputs_s}
            client = {k.removeprefix("@"): int(v) for k, _, v in (f.partition("=") for f in extra if f.startswith("@"))}
            extra = [f for f in extra if not f.startswith("@")]
            receive = torch.device("cpu") if client.pop("cpu", 0) else device
            replicas = client.pop("replicas", 1)
            flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--model", str(ckpt),
                     "--dummy-weights", *extra]  # the service's own defaults: what a user gets
            flags += ["--device", "cpu"] if device.type == "cpu" else ["--dtype", str(dtype).removeprefix("torch.")]
            for proc in procs:
                proc.terminate(timeout=60)
            # Replicas on the same device, behind the client's round_robin channel (as the LLM takes a pool).
            procs = [ServiceProcess(case.service, flags).start() for _ in range(replicas)]
            for proc in procs:
                proc.wait_listening(600)
                proc.wait_serving(timeout=900)
            target = procs[0].target if replicas == 1 else "ipv4:" + ",".join(p.target for p in procs)
            print(f"{case.name} [{name}]: serving at {target}; load starts", flush=True)
            row.update(asyncio.run(drive(target, modality, work, args.clients, receive,
                                         service_pids=[p.proc.pid for p in procs],
                                         readings=lambda: service_sums(procs), **client)))
            row["replicas"] = replicas
            before, after = row.pop("readings")
            row["mean_batch"] = mean_between(before, after, "modalmesh_batch_size")
            row["server_ms"] = mean_between(before, after, "modalmesh_request_duration_seconds") * 1e3
            row["stages_ms"] = {stage: round(mean_between(before, after, "modalmesh_encode_stage_seconds", stage)
                                             * 1e3, 2) for stage in STAGES}
            # The worker's batches: each phase's mean, and its share of the load's wall time (device: how
            # much of the time the stream had a batch on it; launch + wait + idle: the worker's whole time).
            row["phases_ms"] = {phase: round(mean_between(before, after, "modalmesh_encoder_batch_seconds", phase)
                                             * 1e3, 2) for phase in PHASES}
            row["phases_share"] = {phase: round(delta(before, after, "modalmesh_encoder_batch_seconds_sum", phase)
                                                / row["wall_s"], 3) for phase in PHASES}
            row["service_vs_tower"] = row["items_s"] / tower
            rows.append(row)
    finally:
        for proc in procs:
            proc.terminate(timeout=60)
    return rows


def variant(text: str) -> tuple[str, list[str]]:
    """NAME=FLAGS (FLAGS split on spaces), e.g. "window8=--batch-window-ms=8". Flags starting with @ are the
    load's own: @distinct=K (cache hits), @cpu=1 (embeddings to the CPU), @replicas=K (K services on the same
    device behind one round_robin target). Each variant starts its own services."""
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=FLAGS")
    return name, flags.split()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=0, help="per case (0: the case's default)")
    parser.add_argument("--iters", type=int, default=10, help="tower-only timing iterations")
    parser.add_argument("--variant", dest="variants", action="append", type=variant, default=[],
                        help="NAME=FLAGS: also run the service with these extra flags on the same inputs (repeat "
                             "it; A/B in one run). Without it: one run with the service's defaults")
    parser.add_argument("--no-tower", action="store_true", help="skip timing the tower alone")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        args.clients = min(args.clients, 8)
        args.iters = min(args.iters, 2)
    args.variants = args.variants or [("default", [])]
    rows = [row for name in args.only.split(",") for row in run_case(CASES[name], args, device, dtype)]
    print(f"\n{args.clients} concurrent clients, one item per Encode call, embeddings copied to {device}")
    print(f"{'case':>8} | {'variant':>12} | {'service':>9} | {'tower only':>10} | {'ratio':>5} | {'target':>7} | {'p50 ms':>7} | "
          f"{'p99 ms':>7} | {'batch':>5}")
    for r in rows:
        print(f"{r['case']:>8} | {r['variant']:>12} | {r['items_s']:9.1f} | {r['tower_items_s']:10.1f} | {r['service_vs_tower']:5.2f} | "
              f"{r['target']:7.0f} | {r['p50_ms']:7.1f} | {r['p99_ms']:7.1f} | {r['mean_batch']:5.1f}  ({r['unit']}/s)")
    for r in rows:
        print(f"{r['case']} [{r['variant']}] mean ms a call: in the service {r['server_ms']:.1f} ("
              + ", ".join(f"{k} {v}" for k, v in r["stages_ms"].items()) + f"); at the client {r['mean_ms']:.1f} ("
              + ", ".join(f"{k} {v}" for k, v in r["client_ms"].items())
              + f"; the RPC beyond the service {r['client_ms'].get('rpc', float('nan')) - r['server_ms']:.1f})")
        print(f"{r['case']} [{r['variant']}] the worker's batches, mean ms (share of the wall time): "
              + ", ".join(f"{k} {r['phases_ms'][k]} ({100 * r['phases_share'][k]:.0f}%)" for k in PHASES))
        print(f"{r['case']} [{r['variant']}] busiest threads: " + ", ".join(r["busiest_threads"]))
    print("RESULT " + json.dumps([{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
