"""`modalmesh demo`: the stack on local processes, three real requests, a few metrics, then stop.

The default tiny LLM is a vision-language model (Qwen2-VL), which takes no audio; the audio
request goes to the stack's second LLM (audio_llm) on the tiny Qwen2-Audio checkpoint, fed by
the stack's audio encoder (which serves that checkpoint's tower). Outputs are meaningless:
the checkpoints are random.
"""

from __future__ import annotations

import argparse
import io
import math
import tempfile
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb
from modalmesh.ops import stack
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.codec import to_proto


def _png() -> bytes:
    y, x = np.mgrid[0:96, 0:128]
    pixels = np.stack([x * 2, y * 2, (x + y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _wav() -> bytes:
    import soundfile as sf

    t = np.arange(32000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * math.pi * 440 * t)).astype(np.float32), 16000, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _generate(target: str, prompt: str, item: pb.MultimodalItem) -> str:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=[pb.ContentPart(item=item),
                                                                  pb.ContentPart(text=prompt)])])
    request = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(temperature=0.0, max_tokens=16))
    text, usage = "", None
    with grpc.insecure_channel(target) as channel:
        for reply in pb.llm_pb2_grpc.LLMServiceStub(channel).Generate(request, timeout=300):
            text += reply.text
            usage = reply.usage
    return f"{text!r}  ({usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens)"


def _metrics(port: int) -> dict[tuple, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(body)
            for s in f.samples}


def _pick(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def demo(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="modalmesh-demo-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    members = stack.start_stack(args)
    by_name = {m.service: m.process for m in members}
    audio_llm = None
    try:
        stack.print_endpoints(members, args.host)
        host = "127.0.0.1" if args.host == "0.0.0.0" else args.host
        audio_target = f"{host}:{by_name[stack.AUDIO_LLM].grpc_port}" if stack.AUDIO_LLM in by_name else None
        if audio_target is None:  # --services without it: one more LLM, on the audio encoder's checkpoint
            audio_ckpt = stack.default_checkpoints(Path(args.models_dir), ["audio_encoder"])["audio_encoder"]
            audio_llm = ServiceProcess("llm", ["--host", args.host, "--port", "0", "--metrics-port", "0", "--device",
                                               args.device, "--model", str(audio_ckpt), "--audio-encoder",
                                               f"ipv4:{host}:{by_name['audio_encoder'].grpc_port}"]).start()
            audio_llm.wait_serving(timeout=args.startup_timeout, host=host)
            audio_target = f"{host}:{audio_llm.grpc_port}"

        print("\n1. image + text -> llm (the LLM sends the image to the vision encoder pool)")
        image = pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=_png()))
        print("   ", _generate(f"{host}:{by_name['llm'].grpc_port}", "Describe the image.", image))

        print("2. audio + text -> a tiny Qwen2-Audio llm (it sends the clip to the audio encoder pool)")
        audio = pb.MultimodalItem(modality=pb.AUDIO, input=pb.EncodeItem(data=_wav()))
        print("   ", _generate(audio_target, "What do you hear?", audio))

        print("3. latents -> vae -> PNG")
        latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
        with grpc.insecure_channel(f"{host}:{by_name['vae'].grpc_port}") as channel:
            reply = pb.vae_pb2_grpc.VAEServiceStub(channel).Decode(
                pb.DecodeRequest(latents=to_proto(latents), output=pb.PNG), timeout=300)
        path = out_dir / "demo.png"
        path.write_bytes(reply.png[0])
        print(f"    wrote {path} ({Image.open(path).size[0]}x{Image.open(path).size[1]})")

        llm = _metrics(by_name["llm"].metrics_port)
        vision = _metrics(by_name["vision_encoder"].metrics_port)
        print("\nmetrics (from the services' /metrics endpoints):")
        print(f"    llm: {_pick(llm, 'modalmesh_generation_tokens_total'):.0f} tokens generated, "
              f"KV pool {_pick(llm, 'modalmesh_kv_pool_capacity_tokens', pool='kv'):.0f} tokens, "
              f"{_pick(llm, 'modalmesh_transfer_bytes_total', direction='received'):.0f} embedding bytes received")
        print(f"    vision_encoder: {_pick(vision, 'modalmesh_encoded_items_total'):.0f} images encoded, "
              f"attention backend {[dict(k[1])['backend'] for k in vision if k[0] == 'modalmesh_attention_backend_info']}")
        print("\nthe checkpoints are tiny and random: the text above is meaningless by design")
        return 0
    finally:
        if audio_llm is not None:
            audio_llm.terminate(timeout=60)
        codes = stack.stop_stack(members)
        print("stopped: " + ", ".join(f"{s}={c}" for s, c in codes.items()))
