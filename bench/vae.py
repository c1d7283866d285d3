"""VAE decode: ours vs diffusers' AutoencoderKL.decode in the same run, and the largest tiled decode.

    python bench/vae.py                  # on a GPU: SDXL-VAE shape, 512^2 and 1024^2, FP32 and bf16
    python bench/vae.py --quick          # tiny shapes; also runs on CPU (checks the script, not speed)
    python bench/vae.py --model DIR      # a real diffusers VAE directory instead of random weights
    python bench/vae.py --peer-compile default,max-autotune --peer-channels-last   # diffusers compiled, as its docs do
    python bench/vae.py --sizes 1024 --largest '' --profile   # where our decoder's kernel time goes at 1024^2

Random weights in the SDXL VAE shape (block_out_channels 128/256/512/512,
2 layers per block, 4 latent channels, scaling 0.13025) unless --model is
given: diffusers' model is built from that config in code (nothing is
downloaded) and its weights are copied into ours, so both decode the same
function and the table shows the difference between the two outputs too.
Timing: CUDA events around each call after warm-up, median of --iters. "ours graphed" is the service's
path on CUDA: the engine's decode, replaying the CUDA graph of the tile's shape (the size as the tile,
channels-last where the NHWC column runs). "ours unfused" is our decoder
with PyTorch's GroupNorm and SiLU (`fused_kernels=False`, NCHW): what the Triton GroupNorm bought.
"Speedup" is over ours' best fused column.
Baselines measured on one H200 (diffusers): 85 ms bf16, 114 ms FP32 at 1024^2.

diffusers under `torch.compile` (`--peer-compile`, default mode by default; `none` skips it):
`torch.compile(vae.decode, mode=...)` per dtype and size, timed like the eager column, with
its first call's seconds (the compile; cold only where the printed inductor cache was empty)
and ours' speedup over it: a user compiles the peer in one line, so that is the column to beat.
`--peer-channels-last` puts diffusers' model and latents in channels-last for those columns
(diffusers' own torch.compile recipe; its eager column stays NCHW). `--profile`: our decoder
(and its NHWC twin) at the largest size of each dtype under torch.profiler: wall vs kernel-busy
ms per call, time per kernel family and the top kernels (CPU op time on a CPU), printed after
the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import (PEER_COMPILE_HELP, compile_peer, inductor_cache_state, peer_compile_modes,  # noqa: E402
                   print_profile, profile_kernels, release_compiled, timer)
from modalmesh.attention import configure  # noqa: E402
from services.vae.config import VAEConfig, find_vae_dir  # noqa: E402
from services.vae.engine import OFF, ON, TilingDefaults, TilingRequest, VAEEngine  # noqa: E402
from services.vae.weights import build_decoder, load_decoder_state  # noqa: E402

SDXL_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=0.13025, force_upcast=True,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
QUICK_VAE = {**SDXL_VAE, "block_out_channels": (16, 32), "norm_num_groups": 8, "sample_size": 64,
             "down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build_reference(args, device):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    if args.model:
        ref = AutoencoderKL.from_pretrained(find_vae_dir(args.model))
    else:
        ref = AutoencoderKL(**(QUICK_VAE if args.quick else SDXL_VAE))  # diffusers' own random init
    return ref.to(device).eval().requires_grad_(False)


def build_ours(cfg: VAEConfig, state, device, dtype, seqlen_hint, channels_last=False, fused=True):
    model = build_decoder(cfg, dtype=dtype, seqlen_hint=seqlen_hint, fused_kernels=fused)
    load_decoder_state(model, state, device=device, dtype=dtype)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def side_column(name: str, model, z, device, args) -> float:
    """ms per image of one of ours' side columns (NaN when skipped); one that fails prints why and the row,
    with the figures already measured, still prints (a launch that failed on a GPU once cost a whole call's)."""
    if model is None:
        return float("nan")
    try:
        return timer(lambda: model(z), device, args.warmup, args.iters) / args.batch
    except RuntimeError as e:
        print(f"# {name}: failed: {type(e).__name__}: {e}", flush=True)
        return float("nan")


def graphed_column(cfg: VAEConfig, model, channels_last: bool, z, device, args) -> float:
    """ms per image through the service's engine with CUDA graphs (`--cuda-graphs`): the size as its tile, so
    the decode replays the graph of its batch (NaN off CUDA or with --no-cuda-graphs)."""
    if model is None or device.type != "cuda" or args.no_cuda_graphs:
        return float("nan")
    side = z.shape[-1]
    engine = VAEEngine(cfg, model, device=device, dtype=z.dtype, channels_last=channels_last, cuda_graphs=True,
                       tiling=TilingDefaults(tile=side, overlap=side // 4, threshold=side, batch=z.shape[0]))
    engine.warm_up()
    if engine.graphs is None:
        print("# ours graphed: no graphs (capture failed or the tile batch does not fit)", flush=True)
        return float("nan")
    ms = timer(lambda: engine.decode(z, TilingRequest(mode=OFF)), device, args.warmup, args.iters) / args.batch
    engine.graphs = None  # its graphs hold engine._forward: the cycle kept the pool past `del engine`
    del engine
    torch.cuda.empty_cache()  # the graphs' pool
    return ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a diffusers VAE directory (default: random SDXL-shaped weights)")
    parser.add_argument("--dummy-weights", action="store_true", default=True,
                        help="random weights in the SDXL VAE shape (the default without --model)")
    parser.add_argument("--sizes", default="512,1024", help="image sides in pixels")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-channels-last", action="store_true", help="skip the NHWC column")
    parser.add_argument("--no-unfused", action="store_true",
                        help="skip the column of ours without its Triton GroupNorm(+SiLU) (PyTorch's, NCHW)")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark for both")
    parser.add_argument("--attention-backend", default=None, help="e.g. vae=sdpa_efficient")
    parser.add_argument("--largest", default="bfloat16", help="dtype for the largest tiled decode ('' skips it)")
    parser.add_argument("--largest-sides", default="2048,4096,8192,12288,16384")
    parser.add_argument("--tile-batch", type=int, default=4)
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="no graphed column, and the tiled decode eager (the service's --no-cuda-graphs)")
    parser.add_argument("--largest-channels-last", action="store_true",
                        help="the tiled decode on a channels-last model (the service's --channels-last)")
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (runs on CPU)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--peer-compile", default="default", metavar="MODES", help=PEER_COMPILE_HELP)
    parser.add_argument("--ours-compile", default="none", metavar="MODES",
                        help="also time our NHWC decoder under torch.compile in these modes (as --peer-compile), "
                             "printed under the table beside its eager time")
    parser.add_argument("--peer-channels-last", action="store_true",
                        help="diffusers' compiled columns on a channels-last model and latents (its eager stays NCHW)")
    parser.add_argument("--profile", action="store_true",
                        help="our decoder under torch.profiler at the largest size: busy vs wall, top kernels")
    args = parser.parse_args(argv)
    compile_modes = peer_compile_modes(args.peer_compile)
    ours_compile_modes = peer_compile_modes(args.ours_compile, "--ours-compile")

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.quick:
        args.sizes, args.warmup, args.iters = args.sizes and "64,128", 1, 2
        args.largest_sides = "256,512"
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    configure(args.attention_backend, device=device)
    torch.set_grad_enabled(False)

    import diffusers

    reference = build_reference(args, device)
    cfg = VAEConfig.from_dict({"_class_name": "AutoencoderKL", **{k: v for k, v in reference.config.items()
                                                                    if not k.startswith("_")}})
    full_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}  # FP32, restored per dtype
    state = {k: v for k, v in full_state.items() if k.startswith(("decoder.", "post_quant_conv."))}
    sizes = [int(s) for s in args.sizes.split(",") if s]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# VAE decode on {gpu}: torch {torch.__version__}, diffusers {diffusers.__version__}, "
          f"batch {args.batch}, {'model ' + args.model if args.model else 'random weights (SDXL VAE shape)'}, "
          f"cudnn.benchmark={torch.backends.cudnn.benchmark}, cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}")
    peer_layout = " NHWC" if args.peer_channels_last else ""
    if compile_modes:
        print(f"# diffusers' decode under torch.compile{' (channels-last)' if peer_layout else ''}, modes "
              f"{', '.join(compile_modes)}; speedup = diffusers' ms over ours' best; inductor cache "
              f"{inductor_cache_state()}")
    header = ["size", "dtype", "attention", "ours ms/img", "ours NHWC ms/img", "ours graphed ms/img",
              "ours unfused ms/img",
              "diffusers ms/img", "speedup"]
    for mode in compile_modes:
        header += [f"diffusers {mode}{peer_layout} ms/img", "compile s", "speedup"]
    header += ["ours peak GiB", "diffusers peak GiB", "max|ours-diffusers|"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    profiles = []
    for dtype_name in [d for d in args.dtypes.split(",") if d and sizes]:  # --sizes '': the tiled decode alone
        dtype = DTYPES[dtype_name]
        reference.float().load_state_dict(full_state)  # exact FP32 weights, then this dtype (as ours gets them)
        ref = reference.to(dtype)
        hint = (max(sizes) // cfg.scale_factor) ** 2
        ours = build_ours(cfg, state, device, dtype, hint)
        nhwc = None if args.no_channels_last else build_ours(cfg, state, device, dtype, hint, channels_last=True)
        unfused = None if args.no_unfused else build_ours(cfg, state, device, dtype, hint, fused=False)
        backend = ours.decoder.mid_block.attentions[0].attn.backend_name if cfg.mid_block_add_attention else "-"
        for size in sizes:
            side = size // cfg.scale_factor
            z = torch.randn(args.batch, cfg.latent_channels, side, side, device=device,
                            generator=torch.Generator(device).manual_seed(size)).to(dtype)
            diff = (ours(z).float() - ref.decode(z).sample.float()).abs().max().item()
            reset_peak(device)
            ours_ms = timer(lambda: ours(z), device, args.warmup, args.iters) / args.batch
            ours_peak = peak_gib(device)
            zc = z.contiguous(memory_format=torch.channels_last)
            nhwc_ms = side_column(f"ours NHWC, {size}x{size} {dtype_name}", nhwc, zc, device, args)
            graphed_ms = graphed_column(cfg, nhwc if nhwc is not None else ours, nhwc is not None, z, device, args)
            unfused_ms = side_column(f"ours unfused, {size}x{size} {dtype_name}", unfused, z, device, args)
            reset_peak(device)
            ref_ms = timer(lambda: ref.decode(z).sample, device, args.warmup, args.iters) / args.batch
            ref_peak = peak_gib(device)
            best = min(t for t in (ours_ms, nhwc_ms, graphed_ms) if t == t)  # NaN: not measured
            compiled_cells = ""
            for mode in compile_modes:
                if args.peer_channels_last:
                    ref.to(memory_format=torch.channels_last)
                zin = z.contiguous(memory_format=torch.channels_last) if args.peer_channels_last else z
                forward, compile_s, why = compile_peer(ref.decode, lambda decode: decode(zin).sample, mode, device)
                if forward is None:
                    print(f"# diffusers compiled ({mode}), {size}x{size} {dtype_name}: not run: {why}")
                    compiled_cells += " n/a | - | - |"
                else:
                    compiled_ms = timer(forward, device, args.warmup, args.iters) / args.batch
                    compiled_cells += f" {compiled_ms:.2f} | {compile_s:.1f} | {compiled_ms / best:.2f}x |"
                    del forward
                    release_compiled(device)
                if args.peer_channels_last:
                    ref.to(memory_format=torch.contiguous_format)  # its eager column stays NCHW
            print(f"| {size}x{size} | {dtype_name} | {backend} | {ours_ms:.2f} | {nhwc_ms:.2f} | {graphed_ms:.2f} | "
                  f"{unfused_ms:.2f} | "
                  f"{ref_ms:.2f} | "
                  f"{ref_ms / best:.2f}x |{compiled_cells} {ours_peak:.2f} | {ref_peak:.2f} | {diff:.2e} |", flush=True)
            for mode in ours_compile_modes:  # our own decoder compiled: does inductor find more than our kernels?
                target, zin = (nhwc, zc) if nhwc is not None else (ours, z)
                forward, compile_s, why = compile_peer(target, lambda model: model(zin), mode, device)
                if forward is None:
                    print(f"# ours compiled ({mode}), {size}x{size} {dtype_name}: not run: {why}", flush=True)
                    continue
                compiled_ms = timer(forward, device, args.warmup, args.iters) / args.batch
                eager_ms = nhwc_ms if nhwc is not None else ours_ms
                print(f"# ours compiled ({mode}, {'NHWC' if nhwc is not None else 'NCHW'}), {size}x{size} "
                      f"{dtype_name}: {compiled_ms:.2f} ms/img against {eager_ms:.2f} eager (compile {compile_s:.1f} s, "
                      f"max|compiled-eager| {(forward().float() - target(zin).float()).abs().max().item():.2e})",
                      flush=True)
                del forward
                release_compiled(device)
            if args.profile and size == max(sizes):
                calls = {f"ours NCHW {dtype_name}": lambda: ours(z)}
                if nhwc is not None:
                    calls[f"ours NHWC {dtype_name}"] = lambda: nhwc(zc)
                profiles.append((f"{size}x{size} {dtype_name}, batch {args.batch}",
                                 profile_kernels(calls, device, max(3, args.iters // 2))))
        del ours, nhwc, unfused
        reset_peak(device)
    for title, profiled in profiles:
        print_profile(profiled, device, title)
    del reference, full_state

    if args.largest:
        dtype = DTYPES[args.largest]
        tiling = TilingDefaults.for_config(cfg, batch=args.tile_batch)
        model = build_ours(cfg, state, device, dtype, tiling.tile ** 2)
        engine = VAEEngine(cfg, model, device=device, dtype=dtype, tiling=tiling,
                           channels_last=args.largest_channels_last, cuda_graphs=not args.no_cuda_graphs)
        engine.warm_up()  # as the service does before SERVING: on CUDA, the tile's graphs captured
        print(f"\n# largest tiled decode ({args.largest}, tiles {tiling.tile}/{tiling.overlap} latent, "
              f"{tiling.batch} per call, {'NHWC' if args.largest_channels_last else 'NCHW'}, "
              f"{'graphs of ' + str(engine.graphs.sizes) if engine.graphs else 'eager'})")
        # first: after the engine's warm-up (as a service's first request); warm: the same shape again
        print("| size | tiles | first s (after the warm-up) | warm s | peak GiB | result |")
        print("|---|---|---|---|---|---|")
        largest = None
        for size in [int(s) for s in args.largest_sides.split(",") if s]:
            side = size // cfg.scale_factor
            z = torch.randn(1, cfg.latent_channels, side, side, device=device)
            reset_peak(device)
            start = time.perf_counter()
            try:
                seconds = []
                for _ in range(2):
                    result = engine.decode(z, TilingRequest(mode=ON))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    seconds.append(time.perf_counter() - start)
                    start = time.perf_counter()
            except Exception as exc:  # noqa: BLE001 - OOM (ResourceExhausted) ends the search
                print(f"| {size}x{size} | - | - | - | {peak_gib(device):.2f} | {type(exc).__name__}: {exc} |")
                break
            ok = bool(torch.isfinite(result.pixels).all())
            print(f"| {size}x{size} | {result.tiles} | {seconds[0]:.2f} | {seconds[1]:.2f} | {peak_gib(device):.2f} | "
                  f"{'ok' if ok else 'non-finite'} |", flush=True)
            largest = size
            del result
        print(f"\nlargest tiled decode: {largest}x{largest}" if largest else "\nno tiled decode succeeded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
