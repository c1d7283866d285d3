"""Vision towers, ours beside HF transformers in the same run: images/s, backend, bf16 agreement.

    python bench/vision.py                 # on a GPU: real shapes, bf16, random (--dummy-weights) weights
    python bench/vision.py --quick         # tiny shapes, also on CPU (checks the script, not speed)
    python bench/vision.py --only siglip-b32 --iters 50 --attention-backend vision_encoder=sdpa_cudnn
    python bench/vision.py --peer-compile default,max-autotune   # HF under torch.compile too, one column per mode
    python bench/vision.py --only siglip-b32 --profile --no-hf   # where our tower's kernel time goes

Cases (baselines on one H200 from docs/architecture.md: SigLIP 495 img/s at batch 32, Qwen2-VL tower 131 img/s):
  siglip-b1, siglip-b32   SigLIP-so400m-patch14-384 vision model (27 x 1152, 729 patches), batch 1 / 32
  qwen2vl-8x448           Qwen2-VL-7B vision tower (32 x 1280, 16 heads) on 8 images of 448x448
  qwen25vl-8x448          Qwen2.5-VL-7B vision tower (window attention) on the same 8 images

No downloads: configs are written in code, HF models built from them on the device, ours
built from the same config.json with --dummy-weights, then given the HF model's weights
(so the two can be compared: max |ours - HF| relative to max |HF|). Timing: CUDA events,
warm-up, median of `--iters` runs of the tower forward on device-resident pixels (both
sides alike); "graphed" is SigLIP's forward as the service runs it on CUDA (a replay of its CUDA
graph for that batch size), and the speedups over HF are over ours' best; ours end-to-end (`encode`
of CPU-preprocessed items: host->device, forward; the rows stay on the device) and CPU
preprocessing (`prepare`, one thread) are printed beside it.

HF under `torch.compile` (`--peer-compile`, default mode by default; `none` skips it): the first
`--hf-attn` implementation's model compiled with `torch.compile(model, mode=...)`, timed like the
eager column, with its first call's seconds (the compile; cold only where the printed inductor
cache was empty) and ours' speedup over it: a user compiles the peer in one line, so that is the
column to beat. `--profile`: our tower's forward at each case's shape under torch.profiler: wall
vs kernel-busy ms per call, time per kernel family and the top kernels (CPU op time on a CPU),
printed after the table.

Preprocessing, CPU path against device path (`--preprocess-device`), on JPEGs of the case's
side (448² for Qwen2-VL, 384² for SigLIP), images/s:
  cpu prep      the exact PIL path's `prepare` on one thread (decode, resize, rescale, normalise, patchify)
  dev decode    the device path's `prepare` on one thread, PIL decoding (decode and RGB only)
  dev xform     the device path's batched upload + resize + normalise + patchify (`_device_pixels`)
  dev e2e       the device path's `encode` (upload, transforms, forward)
  nvjpeg prep / xform / e2e   the same with the JPEGs decoded on the device (`--image-decode nvimgcodec`:
                `prepare` reads the header and hashes; xform includes the batch's decode); n/a without it
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import (PEER_COMPILE_HELP, compile_peer, inductor_cache_state, peer_compile_modes,  # noqa: E402
                   print_profile, profile_kernels, release_compiled, timer)
from modalmesh import attention, pb  # noqa: E402
from modalmesh.errors import ConfigError  # noqa: E402
from modalmesh.rpc.codec import to_proto  # noqa: E402
from PIL import Image  # noqa: E402
from modalmesh.weights import load_weights  # noqa: E402
from services.vision_encoder.model import build_encoder_model  # noqa: E402

BASELINES = {"siglip-b32": 495.0, "qwen2vl-8x448": 131.0}  # HF img/s on one H200 (docs/architecture.md)


@dataclass
class Case:
    name: str
    family: str  # "siglip" | "qwen2_vl" | "qwen2_5_vl"
    batch: int
    image: int  # side in pixels


CASES = [Case("siglip-b1", "siglip", 1, 384), Case("siglip-b32", "siglip", 32, 384),
         Case("qwen2vl-8x448", "qwen2_vl", 8, 448), Case("qwen25vl-8x448", "qwen2_5_vl", 8, 448)]


def hf_config(family: str, quick: bool):
    """The HF config (real shapes, or tiny ones with --quick) and the preprocessor_config.json dict."""
    import transformers as tf

    if family == "siglip":
        dims = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    image_size=384, patch_size=14)
        if quick:
            dims.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        image_size=60)  # not a multiple of the patch, like 384 / 14
        cfg = tf.SiglipVisionConfig(**dims, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                                    architectures=["SiglipVisionModel"])
        side = dims["image_size"]
        proc = {"image_processor_type": "SiglipImageProcessor", "size": {"height": side, "width": side},
                "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3, "rescale_factor": 1 / 255}
        return cfg, proc
    proc = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
            "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "resample": 3}
    text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=1, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064)
    if quick:
        text.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                               "mrope_section": [16, 24, 24] if not quick else [2, 3, 3]}
    if family == "qwen2_vl":
        vision = dict(depth=32, embed_dim=1280, hidden_size=text["hidden_size"], num_heads=16, mlp_ratio=4)
        if quick:
            vision.update(depth=2, embed_dim=64, num_heads=4)
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision,
                                architectures=["Qwen2VLForConditionalGeneration"]), proc
    vision = dict(depth=32, hidden_size=1280, out_hidden_size=text["hidden_size"], intermediate_size=3420,
                  num_heads=16, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
    if quick:
        vision.update(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, fullatt_block_indexes=[1, 3])
    return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                               architectures=["Qwen2_5_VLForConditionalGeneration"]), proc


def hf_model(family: str, cfg, device, dtype, attn: str):
    import transformers as tf

    cls = {"siglip": tf.SiglipVisionModel,
           "qwen2_vl": tf.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel,
           "qwen2_5_vl": tf.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel}[family]
    sub = cfg if family == "siglip" else cfg.vision_config
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(sub, dtype=dtype, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()


def write_checkpoint(cfg, proc: dict, root: Path) -> Path:
    """A config-only checkpoint (`hf_config`'s pair) in `root`: models load it with dummy weights."""
    cfg.save_pretrained(root)
    (root / "preprocessor_config.json").write_text(json.dumps(proc))
    return root


def timed(fn, iters: int, device: torch.device) -> float:
    """Median milliseconds per call after 3 warm-up calls (bench.timer)."""
    return timer(fn, device, 3, iters)


def jpeg_items(batch: int, side: int, seed: int = 0) -> list[pb.EncodeItem]:
    """Photo-like JPEGs (smooth colour fields: random pixels would make decoding unrealistically slow)."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(batch):
        coarse = Image.fromarray(rng.integers(0, 256, (side // 16 + 2, side // 16 + 2, 3), np.uint8))
        buf = io.BytesIO()
        coarse.resize((side, side), Image.Resampling.BICUBIC).save(buf, format="JPEG", quality=90)
        items.append(pb.EncodeItem(data=buf.getvalue()))
    return items


def preprocess_rates(model_dir, exact, case: Case, args, device, dtype, side: int) -> dict:
    """img/s of the CPU path's prepare (`exact`: a model on that path), the device path's prepare (decode)
    and its device transforms."""
    items = jpeg_items(case.batch, side)
    on_device = build_encoder_model(model_dir, device=device, dtype=dtype, dummy=True,
                                    options={"preprocess_device": "device", "image_decode": "pil",
                                             "siglip_mlp_pad_to": args.siglip_mlp_pad_to})
    rates = {**_path_rates(exact, "cpu", items, args, device), **_path_rates(on_device, "dev", items, args, device)}
    try:
        nvjpeg = build_encoder_model(model_dir, device=device, dtype=dtype, dummy=True,
                                     options={"preprocess_device": "device", "image_decode": "nvimgcodec",
                                              "siglip_mlp_pad_to": args.siglip_mlp_pad_to})
    except ConfigError as e:  # no CUDA, or nvImageCodec not installed
        print(f"# nvjpeg columns: n/a ({e})", file=sys.stderr)
        return {**rates, "nvjpeg_prep": "n/a", "nvjpeg_xform": "n/a", "nvjpeg_e2e": "n/a"}
    return {**rates, **_path_rates(nvjpeg, "nvjpeg", items, args, device)}


def _path_rates(model, path: str, items, args, device) -> dict:
    t0 = time.perf_counter()
    prepared = [model.prepare(item, i) for i, item in enumerate(items)]
    rates = {f"{path}_prep": len(items) / (time.perf_counter() - t0)}
    if path != "cpu":
        with torch.inference_mode():
            rates[f"{path}_xform"] = len(items) / timed(lambda: model._device_pixels(prepared), args.iters,
                                                        device) * 1e3
            rates[f"{path}_e2e"] = len(items) / timed(lambda: model.encode(prepared), max(3, args.iters // 2),
                                                      device) * 1e3
    return rates


def case_side(case: Case, quick: bool) -> int:
    return 56 if quick else case.image


def build_ours(model_dir, device, dtype, fused_kernels: bool = True, siglip_mlp_pad_to: int | None = None):
    """Our encoder on `model_dir` (dummy weights) as the bench times it: SigLIP returns HF's both outputs."""
    return build_encoder_model(model_dir, device=device, dtype=dtype, dummy=True,
                               options={"siglip_output": "both", "preprocess_device": "cpu",
                                        "fused_kernels": fused_kernels, "siglip_mlp_pad_to": siglip_mlp_pad_to})


def tower_inputs(ours, case: Case, side: int, device, dtype):
    """The case's batch of random images through `prepare` (CPU path), and the tower's device-resident inputs:
    (prepared items, ms `prepare` took, pixels, grids or None for SigLIP)."""
    rng = np.random.default_rng(0)
    items = [pb.EncodeItem(pixels=to_proto(torch.from_numpy(rng.integers(0, 256, (side, side, 3), np.uint8))))
             for _ in range(case.batch)]
    t0 = time.perf_counter()
    prepared = [ours.prepare(item, i) for i, item in enumerate(items)]
    prep_ms = (time.perf_counter() - t0) * 1e3
    if case.family == "siglip":
        return prepared, prep_ms, torch.stack([p.inputs["pixel_values"] for p in prepared]).to(device, dtype), None
    grids = [p.meta["grid_thw"] for p in prepared]
    return prepared, prep_ms, torch.cat([p.inputs["pixel_values"] for p in prepared]).to(device, dtype), grids


def run_case(case: Case, args, device, dtype) -> dict:
    cfg, proc = hf_config(case.family, args.quick)
    side = case_side(case, args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(cfg, proc, Path(tmp))
        ours = build_ours(tmp, device, dtype, fused_kernels=not args.no_fused_kernels,
                          siglip_mlp_pad_to=args.siglip_mlp_pad_to)
        rates = preprocess_rates(tmp, ours, case, args, device, dtype, side)
    prepared, prep_ms, pixels, grids = tower_inputs(ours, case, side, device, dtype)
    native = grids is not None
    if native:
        grid_t = torch.tensor(grids, device=device)
    row = {"case": case.name, "batch": case.batch, "tokens": sum(p.cost for p in prepared),
           "backend": ours.tower.blocks[0].attn.attn.backend_name if native
           else ours.tower.encoder.layers[0].self_attn.attn.backend_name}
    with torch.inference_mode():
        ours_fwd = (lambda: ours.tower(pixels, grids)) if native else (lambda: ours.tower(pixels))
        row["ours_ms"] = timed(ours_fwd, args.iters, device)
        graphs = None if native else ours.graphs  # SigLIP on CUDA: what the service replays per batch size
        if graphs is not None and graphs.bucket(case.batch):
            row["graphed_ms"] = timed(lambda: graphs(pixels, copy=False), args.iters, device)
        # the speedups are over ours' best forward: the graphed one where it runs
        row["best_ms"] = min(row["ours_ms"], row.get("graphed_ms", row["ours_ms"]))
        row["e2e_ms"] = timed(lambda: ours.encode(prepared), max(3, args.iters // 2), device)
    if args.profile:
        row["profile"] = profile_kernels({f"ours {case.name} ({row['backend']})": ours_fwd}, device,
                                         max(3, args.iters // 2))
    row["prep_img_s"] = case.batch / prep_ms * 1e3
    row.update(rates)
    if not args.no_hf:
        for attn in args.hf_attn:
            try:
                ref = hf_model(case.family, cfg, device, dtype, attn)
            except (ImportError, ValueError) as e:  # e.g. flash_attention_2 not installed
                row[f"hf_{attn}_ms"] = f"n/a ({type(e).__name__})"
                continue
            with torch.inference_mode():
                if native:
                    call_ref = lambda model: model(pixels, grid_thw=grid_t).pooler_output  # noqa: E731
                else:
                    call_ref = lambda model: model(pixel_values=pixels)  # noqa: E731
                ref_fwd = lambda: call_ref(ref)  # noqa: E731
                row[f"hf_{attn}_ms"] = timed(ref_fwd, args.iters, device)
                if attn == args.hf_attn[0]:  # same weights in ours, then compare
                    load_weights(ours.tower, list(ref.state_dict().items()), ours.tower.weights_mapper,
                                 ours.tower.stacked_params, metrics=False)
                    want = ref_fwd()
                    want = want if native else torch.cat((want.last_hidden_state, want.pooler_output[:, None]), 1)
                    got = ours_fwd()
                    row["rel_err"] = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    for mode in args.compile_modes:  # under inference_mode like the eager column: graphs guard on it
                        forward, row[f"hf_compiled_{mode}_compile_s"], why = compile_peer(ref, call_ref, mode, device)
                        if forward is None:
                            print(f"# {case.name}: HF {attn} compiled ({mode}) not run: {why}", file=sys.stderr)
                            row[f"hf_compiled_{mode}_ms"] = "n/a"
                            continue
                        row[f"hf_compiled_{mode}_ms"] = timed(forward, args.iters, device)
                        del forward
                        release_compiled(device)
            del ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--attention-backend", default=None, help="e.g. vision_encoder=fa3")
    parser.add_argument("--hf-attn", default="sdpa", help="HF attn implementations, comma-separated "
                                                          "(e.g. sdpa,flash_attention_2)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-fused-kernels", action="store_true",
                        help="the towers without their fused kernels (add+norm, rotary, GELU / SiLU*up, the GELU "
                             "epilogue): the A/B")
    parser.add_argument("--siglip-mlp-pad-to", type=int, default=None, metavar="N",
                        help="SigLIP's MLP width rounded up to a multiple of N with zero weights (1: the "
                             "checkpoint's own; default: the service's): the padding's A/B")
    parser.add_argument("--peer-compile", default="default", metavar="MODES",
                        help=PEER_COMPILE_HELP + " (the first --hf-attn model)")
    parser.add_argument("--profile", action="store_true",
                        help="our tower's forward under torch.profiler at each case: busy vs wall, top kernels")
    args = parser.parse_args(argv)
    args.hf_attn = [a for a in args.hf_attn.split(",") if a]
    args.compile_modes = [] if args.no_hf or not args.hf_attn else peer_compile_modes(args.peer_compile)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.quick:
        print("no CUDA device: use --quick (tiny shapes) to check the script on CPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    selector = attention.configure(args.attention_backend, device=device)
    cases = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    if args.quick:
        cases = [Case(c.name, c.family, min(c.batch, 2), 56) for c in cases]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# vision towers on {gpu}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, "
          f"median of {args.iters}{' (quick shapes)' if args.quick else ''}, the towers' fused kernels "
          f"{'off' if args.no_fused_kernels else 'on (on CUDA)'}, SigLIP's MLP padded to a multiple of "
          f"{args.siglip_mlp_pad_to or 'the default'}")
    if args.compile_modes:
        print(f"# HF {args.hf_attn[0]} under torch.compile, modes {', '.join(args.compile_modes)} (x HFc: ours' "
              f"speedup over it); inductor cache {inductor_cache_state()}")
    header = (f"{'case':<16}{'batch':>6}{'tokens':>8}  {'backend':<14}{'ours img/s':>11}{'graphed':>9}"
              f"{'e2e img/s':>11}"
              + "".join(f"{'HF ' + a + ' img/s':>26}" for a in ([] if args.no_hf else args.hf_attn))
              + f"{'x HF':>7}"
              + "".join(f"{'HF ' + m + ' img/s':>26}{'compile s':>10}{'x HFc':>7}" for m in args.compile_modes)
              + f"{'rel err':>10}{'prep img/s':>12}{'baseline':>10}"
              + f"{'cpu prep':>10}{'dev decode':>12}{'dev xform':>11}{'dev e2e':>9}"
              + f"{'nvjpeg prep':>13}{'nvjpeg xform':>14}{'nvjpeg e2e':>12}")
    print(header)
    profiles = []
    for case in cases:
        row = run_case(case, args, device, dtype)
        if "profile" in row:
            profiles.append((f"{case.name}, batch {row['batch']}, {row['tokens']} tokens", row["profile"]))
        ips = lambda ms: f"{row['batch'] / ms * 1e3:.1f}" if isinstance(ms, float) else ms  # noqa: E731
        rate = lambda r: f"{r:.1f}" if isinstance(r, float) else r  # noqa: E731
        hf = [row.get(f"hf_{a}_ms") for a in ([] if args.no_hf else args.hf_attn)]
        first = hf[0] if hf and isinstance(hf[0], float) else None
        speedup = f"{first / row['best_ms']:.2f}" if first else "-"
        compiled = ""
        for mode in args.compile_modes:
            ms, compile_s = row.get(f"hf_compiled_{mode}_ms", "-"), row.get(f"hf_compiled_{mode}_compile_s")
            over = f"{ms / row['best_ms']:.2f}" if isinstance(ms, float) else "-"
            compiled += f"{ips(ms):>26}{compile_s if compile_s is not None else float('nan'):>10.1f}{over:>7}"
        print(f"{row['case']:<16}{row['batch']:>6}{row['tokens']:>8}  {row['backend']:<14}{ips(row['ours_ms']):>11}"
              f"{ips(row.get('graphed_ms', '-')):>9}{ips(row['e2e_ms']):>11}" + "".join(f"{ips(h):>26}" for h in hf)
              + f"{speedup:>7}" + compiled
              + f"{row.get('rel_err', float('nan')):>10.2e}{row['prep_img_s']:>12.1f}"
              + f"{BASELINES.get(case.name, '-')!s:>10}"
              + f"{row['cpu_prep']:>10.1f}{row['dev_prep']:>12.1f}{row['dev_xform']:>11.1f}{row['dev_e2e']:>9.1f}"
              + "".join(f"{rate(row[k]):>{w}}" for k, w in (("nvjpeg_prep", 13), ("nvjpeg_xform", 14),
                                                             ("nvjpeg_e2e", 12))),
              flush=True)
    for title, profiled in profiles:
        print_profile(profiled, device, title)
    for choice in attention.attention_choices(selector):
        print(f"# attention {choice.component}: {choice.backend} ({choice.reason})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
