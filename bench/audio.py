"""Audio encoder throughput: ours vs Hugging Face `WhisperEncoder`, same GPU, same run, beside the limit.

    python bench/audio.py                   # whisper-large-v3 encoder shape, bf16, 30 s clips, batch 1 and 16
    python bench/audio.py --dummy-weights   # ours with dummy weights (no parity check)
    python bench/audio.py --quick           # tiny shape; also runs on CPU (checks the script, not speed)
    python bench/audio.py --batch 1 --profile   # batch 1, ours vs HF: wall, GPU-busy, top kernels
    python bench/audio.py --peer-compile default,max-autotune   # HF under torch.compile too, one column per mode

Both models are built in code (no downloads): HF's `WhisperEncoder` from a
`WhisperConfig` (d_model 1280, 32 layers, 20 heads, ffn 5120, 128 mel bins),
ours through `build_encoder_model` on a config-only checkpoint directory with
``dummy=True`` (the service's ``--dummy-weights``). Unless ``--dummy-weights``
is given, HF's randomly initialised weights are then loaded into ours through
the checkpoint loader (q/k/v -> qkv_proj etc.) and the outputs are compared
(bf16 ours and bf16 HF, each against HF in fp32).

Timed with CUDA events after warm-up: the encoder forward on (B, 128, 3000)
log-mel features, ours vs HF, at each batch size; ours both eager and as the
service runs it on CUDA (a replay of its CUDA graph for that batch size, which
the speedups use); then ours through
`encode()` (the service path: one staged upload, features on the device or
the CPU's mel, forward, row selection; rows stay on the device), and the
preprocessing of one 30 s clip at 16 kHz and 44.1 kHz on each path: the CPU
path's `prepare` (decode, resample, log-mel on one thread) against the device
path's `prepare` (decode, checks) plus its share of the batch's resample +
log-mel on the device. The limit is the forward's FLOPs at the GPU's dense bf16 peak.

HF under `torch.compile` (`--peer-compile`, default mode by default; `none`
skips it) is timed beside its eager column in the same run, at each batch
size, with its first call's seconds (the compile; cold only where the printed
inductor cache was empty): a user compiles the peer in one line, so that is
the column to beat.

`--profile` (at `--profile-batch`, batch 1 by default: the issue-18 question "why is
ours slower than HF at batch 1"): for ours with the selected attention, ours with
each other dense backend that runs here, and HF: wall ms per call (synchronised
each call), busy ms (summed kernel time from torch.profiler; CPU op time on a
CPU), kernels per call, time per kernel family and the top 10 kernels. Wall well
above busy means launch-bound (host overhead); busy above HF's means slower
kernels: the table says which.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import (PEER_COMPILE_HELP, compile_peer, inductor_cache_state, peer_compile_modes,  # noqa: E402
                   print_profile, profile_kernels, release_compiled, sync)
from modalmesh import pb  # noqa: E402
from modalmesh.rpc.codec import to_proto  # noqa: E402
from modalmesh.weights import load_weights  # noqa: E402
from services.audio_encoder.model import AudioEncoderModel, AudioOptions, build_encoder_model  # noqa: E402

LARGE_V3 = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, num_mel_bins=128,
                max_source_positions=1500, decoder_layers=2, decoder_attention_heads=20, decoder_ffn_dim=5120,
                vocab_size=51866)
QUICK = dict(LARGE_V3, d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
             decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=128)
BASELINE = "HF WhisperEncoder on one H200 (docs/architecture.md): 147 clips/s at batch 16, 21 ms at batch 1; limit ~345 clips/s"


def time_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Mean milliseconds per call (CUDA events on a GPU, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def flops_per_clip(shape: dict) -> float:
    """Forward FLOPs of one 30 s window (2 FLOP per multiply-add)."""
    d, f, layers, mels = shape["d_model"], shape["encoder_ffn_dim"], shape["encoder_layers"], shape["num_mel_bins"]
    s = shape["max_source_positions"]
    stem = 2 * 3 * mels * d * (2 * s) + 2 * 3 * d * d * s
    linear = 2 * s * (4 * d * d + 2 * d * f)
    attention = 2 * 2 * s * s * d
    return stem + layers * (linear + attention)


def make_checkpoint(shape: dict) -> Path:
    from transformers import WhisperConfig, WhisperFeatureExtractor

    root = Path(tempfile.mkdtemp(prefix="bench-audio-"))
    WhisperConfig(**shape, architectures=["WhisperForConditionalGeneration"]).save_pretrained(root)
    WhisperFeatureExtractor(feature_size=shape["num_mel_bins"]).save_pretrained(root)
    return root


def build_hf(shape: dict, device: torch.device, dtype: torch.dtype):
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = WhisperEncoder(config)
    return model.to(dtype).eval()


def clip_30s(rate: int = 16000) -> torch.Tensor:
    t = torch.arange(30 * rate, dtype=torch.float64) / rate
    x = 0.3 * torch.sin(2 * math.pi * 440 * t) + 0.2 * torch.sin(2 * math.pi * (100 * t + 50 * t**2))
    return (x + 0.01 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)).float()


def path_models(ours: AudioEncoderModel, device: torch.device) -> dict[str, AudioEncoderModel]:
    """`ours`'s tower behind each preprocessing path (built once: each captures its tower graphs on CUDA)."""
    return {where: AudioEncoderModel(ours.module, ours.features, device=device, dtype=ours.dtype,
                                     options=AudioOptions(preprocess_device=where, warmup=False))
            for where in ("cpu", "device")}


def preprocessing(paths: dict[str, AudioEncoderModel], device: torch.device, batch: int, iters: int) -> dict:
    """ms per 30 s clip on each path (`path_models`), at 16 kHz and 44.1 kHz input."""
    out = {}
    dev = paths["device"]
    for rate in (16000, 44100):
        item = pb.EncodeItem(pcm=to_proto(clip_30s(rate)), sample_rate=rate)
        cpu_ms = time_ms(lambda: paths["cpu"].prepare(item, 0), torch.device("cpu"), iters, 1)
        prep_ms = time_ms(lambda: dev.prepare(item, 0), torch.device("cpu"), iters, 1)
        prepared = [dev.prepare(item, i) for i in range(batch)]
        with torch.inference_mode():
            waves = dev.staging.upload([p.inputs["wave"] for p in prepared])
            rates = [rate] * batch
            device_ms = time_ms(lambda: dev.device_features(waves, rates), device, iters, 2) / batch
        out[rate] = {"cpu_path_ms": cpu_ms, "device_path_prepare_ms": prep_ms, "device_path_device_ms": device_ms}
        print(f"preprocessing, 30 s clip at {rate} Hz: CPU path {cpu_ms:.2f} ms (one thread) | device path: "
              f"prepare {prep_ms:.2f} ms (one thread) + resample/log-mel {device_ms:.3f} ms on {device.type} "
              f"(batch {batch}, per clip)")
    return out


def profiled_models(root: Path, ours, hf, device: torch.device, dtype: torch.dtype, spec: str | None,
                    options: dict) -> dict:
    """Ours as selected, ours with each other dense backend that runs here (same weights), and HF."""
    from modalmesh import attention
    from modalmesh.errors import ConfigError

    selected = ours.module.encoder.layers[0].self_attn.attn.selection.backend
    models = {f"ours ({selected})": ours.module}
    state = ours.module.state_dict()
    for backend in ("fa3", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"):
        if backend == selected:
            continue
        try:
            attention.configure(f"audio_encoder={backend}", device=device)
            alt = build_encoder_model(root, device=device, dtype=dtype, dummy=True, options=options)
        except (ConfigError, ValueError, RuntimeError) as exc:
            print(f"profile: ours with {backend}: not run here ({str(exc).splitlines()[0][:120]})")
            continue
        alt.module.load_state_dict(state)
        models[f"ours ({backend})"] = alt.module
    attention.configure(spec, device=device)  # back to the run's own selection
    if hf is not None:
        models[f"HF ({hf.config._attn_implementation})"] = lambda x: hf(x).last_hidden_state
    return models


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape (any device)")
    parser.add_argument("--dummy-weights", action="store_true", help="ours with dummy weights; skips the parity check")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--attention-backend", default=None, help="override for ours, e.g. 'audio_encoder=sdpa_cudnn'")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense peak of the GPU (H200 bf16: 989)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF peer")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--profile", action="store_true",
                        help="wall vs busy ms, kernel families and top kernels, ours (each dense backend) vs HF")
    parser.add_argument("--profile-batch", type=int, nargs="+", default=[1], help="batch sizes --profile runs")
    parser.add_argument("--peer-compile", default="default", metavar="MODES", help=PEER_COMPILE_HELP)
    parser.add_argument("--no-fused-kernels", action="store_true",
                        help="ours without the add+LayerNorm kernel and the GELU epilogue (the A/B of issue 19)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          args.device if args.device != "auto" else "cpu")
    dtype = getattr(torch, args.dtype)
    compile_modes = [] if args.no_hf else peer_compile_modes(args.peer_compile)
    if args.quick:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    shape = QUICK if args.quick else LARGE_V3

    from modalmesh import attention

    attention.configure(args.attention_backend, device=device)
    root = make_checkpoint(shape)
    options = {"warmup": False, "fused_kernels": not args.no_fused_kernels}
    ours = build_encoder_model(root, device=device, dtype=dtype, dummy=True, options=options)
    selection = ours.module.encoder.layers[0].self_attn.attn.selection
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"Whisper-large-v3 encoder shape{' (quick)' if args.quick else ''}: d_model {shape['d_model']}, "
          f"{shape['encoder_layers']} layers, {shape['encoder_attention_heads']} heads, "
          f"ffn {shape['encoder_ffn_dim']}, {shape['num_mel_bins']} mel bins; {args.dtype} on {gpu}")
    print(f"attention (ours): {selection.backend} [{selection.source}] {selection.reason}")

    hf = None if args.no_hf else build_hf(shape, device, dtype)
    if hf is not None:
        print(f"attention (HF): {hf.config._attn_implementation}")
    if compile_modes:
        print(f"HF under torch.compile, modes {', '.join(compile_modes)}; inductor cache {inductor_cache_state()}")
    results: dict = {"device": gpu, "dtype": args.dtype, "shape": shape, "attention": selection.backend, "batches": {}}

    rows = max(args.batch + (args.profile_batch if args.profile else []))
    mels = torch.randn(rows, shape["num_mel_bins"], 3000, generator=torch.Generator().manual_seed(1))
    mels = mels.to(device, dtype)
    if hf is not None and not args.dummy_weights:
        # HF's random weights into ours through the checkpoint loader, then parity.
        state = ((f"model.encoder.{k}", v) for k, v in hf.state_dict().items())
        load_weights(ours.module, state, ours.module.weights_mapper, ours.module.stacked_params, metrics=False)
        with torch.inference_mode():
            x = mels[:2]
            a, b = ours.module(x).float(), hf(x).last_hidden_state.float()
            exact = hf.float()(x.float()).last_hidden_state
            hf.to(dtype)
        results["parity"] = {"ours_vs_hf": (a - b).abs().max().item(), "ours_vs_fp32": (a - exact).abs().max().item(),
                             "hf_vs_fp32": (b - exact).abs().max().item(), "scale": exact.abs().max().item()}
        p = results["parity"]
        print(f"parity (max |diff|, outputs up to {p['scale']:.3g}): ours vs HF {p['ours_vs_hf']:.4g}; "
              f"vs HF fp32: ours {p['ours_vs_fp32']:.4g}, HF {args.dtype} {p['hf_vs_fp32']:.4g}")

    # Each compiled mode: ms, clips/s, the first call's seconds, and ours' speedup over it.
    graphs = ours.graphs  # the service's forward on CUDA: a CUDA graph per batch size (None on a CPU)
    print(f"{'batch':>5} {'ours ms':>9} {'ours clips/s':>12} {'graphed ms':>10} {'clips/s':>8} {'HF ms':>9} "
          f"{'HF clips/s':>10} {'speedup':>7}"
          + "".join(f" {'HF ' + m + ' ms':>22} {'clips/s':>8} {'compile s':>9} {'speedup':>7}" for m in compile_modes))
    for batch in args.batch:
        x = mels[:batch]
        with torch.inference_mode():
            ours_ms = time_ms(lambda: ours.module(x), device, args.iters, args.warmup)
            graphed_ms = (time_ms(lambda: graphs(x, copy=False), device, args.iters, args.warmup)
                          if graphs is not None and graphs.bucket(batch) else float("nan"))
            hf_ms = time_ms(lambda: hf(x), device, args.iters, args.warmup) if hf is not None else float("nan")
            row = {"ours_ms": ours_ms, "ours_clips_s": batch * 1e3 / ours_ms, "ours_graphed_ms": graphed_ms,
                   "hf_ms": hf_ms, "hf_clips_s": batch * 1e3 / hf_ms}
            best = min(ours_ms, graphed_ms) if graphed_ms == graphed_ms else ours_ms  # graphed, where it ran
            compiled_cells = ""
            for mode in compile_modes:  # under inference_mode like the eager column: the graphs guard on it
                forward, compile_s, why = compile_peer(hf, lambda compiled: compiled(x), mode, device)
                if forward is None:
                    print(f"# HF compiled ({mode}), batch {batch}: not run: {why}")
                    row[f"hf_compiled_{mode}_skipped"] = why
                    compiled_cells += f" {'n/a':>22} {'-':>8} {'-':>9} {'-':>7}"
                    continue
                compiled_ms = time_ms(forward, device, args.iters, args.warmup)
                row.update({f"hf_compiled_{mode}_ms": compiled_ms,
                            f"hf_compiled_{mode}_clips_s": batch * 1e3 / compiled_ms,
                            f"hf_compiled_{mode}_compile_s": compile_s})
                compiled_cells += (f" {compiled_ms:>22.2f} {batch * 1e3 / compiled_ms:>8.1f} {compile_s:>9.1f} "
                                   f"{compiled_ms / best:>6.2f}x")
                del forward
                release_compiled(device)
        results["batches"][batch] = row
        print(f"{batch:>5} {ours_ms:>9.2f} {row['ours_clips_s']:>12.1f} {graphed_ms:>10.2f} "
              f"{batch * 1e3 / graphed_ms:>8.1f} {hf_ms:>9.2f} {row['hf_clips_s']:>10.1f} {hf_ms / best:>6.2f}x"
              + compiled_cells, flush=True)

    big = max(args.batch)
    paths = path_models(ours, device)
    for where, model in paths.items():
        item = pb.EncodeItem(pcm=to_proto(clip_30s(44100)), sample_rate=44100)
        prepared = [model.prepare(item, i) for i in range(big)]
        encode_ms = time_ms(lambda: model.encode(prepared), device, max(1, args.iters // 2), 2)
        results[f"encode_ms_{where}_features"] = encode_ms
        print(f"ours encode() at batch {big}, 30 s 44.1 kHz clips, features from the {where} path "
              f"(staged upload, {'resample + log-mel, ' if where == 'device' else ''}forward, rows stay on "
              f"{device.type}): {encode_ms:.2f} ms = {big * 1e3 / encode_ms:.1f} clips/s")
    results["encode_batch"] = big
    results["preprocessing"] = preprocessing(paths, device, big, max(1, args.iters // 4))
    if args.profile:
        models = profiled_models(root, ours, hf, device, dtype, args.attention_backend, options)
        results["profiles"] = {}
        for batch in args.profile_batch:
            x = mels[:batch]
            calls = {name: (lambda fn=fn: fn(x)) for name, fn in models.items()}
            results["profiles"][batch] = profile_kernels(calls, device, max(3, args.iters // 2))
            print_profile(results["profiles"][batch], device, f"batch {batch}")
        results["profile"] = results["profiles"][args.profile_batch[0]]  # its key before --profile-batch

    flops = flops_per_clip(shape)
    limit = args.peak_tflops * 1e12 / flops
    results.update(tflop_per_clip=flops / 1e12, limit_clips_s=limit)
    print(f"limit: {flops / 1e12:.2f} TFLOP per clip -> {limit:.0f} clips/s at {args.peak_tflops:g} TFLOP/s")
    print(f"baseline: {BASELINE}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
