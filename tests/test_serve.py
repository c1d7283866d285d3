"""`modalmesh serve DIR`: the encoders the checkpoint needs, the LLM and the gateway as local processes, the OpenAI
base URL printed, everything drained on Ctrl-C. Driven with the official openai client; greedy output checked
against transformers' generate on the same tiny checkpoint."""

from __future__ import annotations

import base64
import io
import math
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import openai
import pytest
import soundfile as sf
import torch

from modalmesh.testing import tiny


class Served:
    """A running `modalmesh serve DIR --port 0`; its OpenAI base URL and the processes it listed."""

    def __init__(self, model_dir, *flags):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "modalmesh.ops.cli", "serve", str(model_dir), "--port", "0", "--device", "cpu",
             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.timer = threading.Timer(300, self.proc.kill)  # bounds the test if the stack hangs
        self.timer.start()
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            if "Ctrl-C drains" in line:
                break
        self.out = "".join(lines)
        match = re.search(r"^OpenAI API: (http://127\.0\.0\.1:\d+/v1)", self.out, re.M)
        if match is None:
            self.stop()
            raise AssertionError(self.out)
        self.base_url = match[1]
        self.grpc_services = set(re.findall(r"^(\w+)\s+127\.0\.0\.1:\d+\s+http://", self.out, re.M))
        self.client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> tuple[int, str]:
        """SIGINT, as Ctrl-C: every process drains; (exit code, what it printed after)."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
            rest = self.proc.stdout.read()
            return self.proc.wait(timeout=90), rest
        finally:
            self.timer.cancel()
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def test_serve_a_text_checkpoint_equals_hf_generate(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny.ensure("qwen3", tmp_path)
    served = Served(model_dir)
    try:
        assert served.grpc_services == {"llm"}  # a text model needs no encoder
        model_id = served.client.models.list().data[0].id
        assert model_id == model_dir.name
        r = served.client.completions.create(model=model_id, prompt="Hello world", max_tokens=10, temperature=0.0,
                                             logprobs=0)
        ids = AutoTokenizer.from_pretrained(model_dir)("Hello world")["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        ref = out.sequences[0, len(ids):].tolist()
        ref_lps = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, ref)]
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
        torch.testing.assert_close(torch.tensor(r.choices[0].logprobs.token_logprobs), torch.tensor(ref_lps),
                                   atol=1e-4, rtol=0)
    finally:
        code, rest = served.stop()
    assert code == 0, rest
    assert "stopped: llm=0, gateway=0" in rest


def _wav() -> str:
    t = np.arange(16000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * math.pi * 330 * t)).astype(np.float32), 16000, format="WAV", subtype="FLOAT")
    return base64.b64encode(buf.getvalue()).decode()


def test_serve_an_audio_checkpoint_starts_its_audio_encoder(tmp_path):
    model_dir = tiny.ensure("qwen2_audio", tmp_path)
    served = Served(model_dir, "--served-model-name", "listener")
    try:
        assert served.grpc_services == {"audio_encoder", "llm"}
        r = served.client.chat.completions.create(
            model="listener", max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "input_audio",
                                                    "input_audio": {"data": _wav(), "format": "wav"}},
                                                   {"type": "text", "text": "What do you hear?"}]}])
        assert r.usage.completion_tokens == 4
        # The clip's rows are in the prompt: far more tokens than the text alone.
        text_only = served.client.chat.completions.create(
            model="listener", max_tokens=1, messages=[{"role": "user", "content": "What do you hear?"}])
        assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + 10
    finally:
        code, rest = served.stop()
    assert code == 0, rest
    assert "stopped: audio_encoder=0, llm=0, gateway=0" in rest


@pytest.mark.parametrize("config,words", [(None, "no config.json"), ("not json", "not a checkpoint")])
def test_serve_refuses_what_is_not_a_checkpoint_in_one_line(tmp_path, config, words):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    out = subprocess.run([sys.executable, "-m", "modalmesh.ops.cli", "serve", str(tmp_path), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and words in out.stderr and "Traceback" not in out.stderr, out.stderr
