"""LLM-service language models against their Hugging Face references (CPU, FP32).

Every family is loaded through `load_llm` from a tiny random checkpoint written
by the reference class, run over the paged KV pool, and compared with the
reference's logits at every position (max abs diff <= 1e-4): whole prompts
packed in one forward, prefix + chunks + one-token decode steps of several
sequences in one batch, greedy continuations against ``generate``, and the
language models of Qwen2-VL / Qwen2.5-VL (M-RoPE, 3-D positions) and
Qwen2-Audio fed the same embeddings as the reference text model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from modalmesh import distributed
from modalmesh.attention import AttentionSelector, PagedMetadata, Platform
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from modalmesh.kv.pool import build_kv_pool
from modalmesh.testing import tiny
from modalmesh.weights import CheckpointReader, MissingWeightsError, UnexpectedWeightsError
from modalmesh.weights import loader as weights_loader
from services.llm.loader import load_llm
from modalmesh.models import pick
from services.llm.models import (
    ARCHITECTURES,
    GPTNeoXForCausalLM,
    LlamaForCausalLM,
    Qwen2_5_VLTextForCausalLM,
    Qwen2AudioTextForCausalLM,
    Qwen2ForCausalLM,
    Qwen2VLTextForCausalLM,
    Qwen3ForCausalLM,
)
from services.llm.mrope import mrope_positions

PAGE = 4  # small pages: every sequence spans several, allocated out of order across sequences
TOL = dict(atol=1e-4, rtol=0)
TEXT = ("llama", "qwen2", "qwen3", "gpt_neox")
MM = ("qwen2_vl", "qwen2_5_vl", "qwen2_audio")
REF_CLASS = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
             "qwen2_audio": "Qwen2AudioForConditionalGeneration"}


# ---- checkpoints ------------------------------------------------------------------------------
def _tiny_text(**overrides) -> dict:
    dims = dict(vocab_size=tiny.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                initializer_range=tiny.INIT_RANGE, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    dims.update(overrides)
    return dims


# Variants made here with the reference classes: rope scaling, switches, residual styles, windows.
VARIANTS = {
    "qwen2_yarn": ("Qwen2", _tiny_text(**tiny._rope("yarn", factor=4.0, original_max_position_embeddings=32))),
    "qwen2_linear": ("Qwen2", _tiny_text(**tiny._rope("linear", theta=500.0, factor=2.0))),
    "qwen2_sliding": ("Qwen2", _tiny_text(num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
                                          max_window_layers=1)),
    "llama_bias_tied": ("Llama", _tiny_text(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                            num_key_value_heads=1)),
    "neox_sequential": ("GPTNeoX", dict(vocab_size=tiny.VOCAB_SIZE, hidden_size=64, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                                        rotary_pct=1.0, use_parallel_residual=False, hidden_act="gelu_new",
                                        initializer_range=tiny.INIT_RANGE, bos_token_id=0, eos_token_id=0,
                                        tie_word_embeddings=False)),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llm_models")


def checkpoint(root: Path, name: str) -> Path:
    if name not in VARIANTS:
        return tiny.ensure(name, root)
    out = root / name
    if not (out / "config.json").exists():
        family, kwargs = VARIANTS[name]
        torch.manual_seed(sum(map(ord, name)))
        config = getattr(transformers, f"{family}Config")(**kwargs)
        getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(out)
    return out


_REFS: dict[tuple[Path, str], torch.nn.Module] = {}


def reference(path: Path, name: str) -> torch.nn.Module:
    key = (path, name)
    if key not in _REFS:
        cls = getattr(transformers, REF_CLASS.get(name, "AutoModelForCausalLM"))
        _REFS[key] = cls.from_pretrained(path, dtype=torch.float32).eval()
    return _REFS[key]


def ours(path: Path, **kw):
    model, cfg, _ = load_llm(path, device="cpu", dtype=torch.float32, page_size=PAGE, **kw)
    return model, cfg


def reference_logits(ref, name: str, ids=None, embeds=None, positions=None) -> torch.Tensor:
    """Full-sequence logits (T, V) of the reference; multimodal: its text model + lm_head."""
    with torch.no_grad():
        if name not in REF_CLASS:
            return ref(input_ids=ids[None]).logits[0]
        pos = positions[:, None, :] if positions.dim() == 2 else positions[None]
        if hasattr(ref, "lm_head"):
            hidden = ref.model.language_model(inputs_embeds=embeds[None], position_ids=pos).last_hidden_state
            return ref.lm_head(hidden)[0]
        # transformers 4's Qwen2-Audio wraps a whole causal LM: language_model.{model, lm_head}
        return ref.language_model(inputs_embeds=embeds[None], position_ids=pos).logits[0]


# ---- a minimal engine: the pool, packed batches, paged metadata --------------------------------
class Runner:
    def __init__(self, model, cfg, tokens: int = 2048, tp_size: int = 1):
        self.model = model
        self.pool = build_kv_pool(cfg, "cpu", max_model_len=256, page_size=PAGE, kv_cache_tokens=tokens,
                                  dtype=torch.float32, tp_size=tp_size)
        self.caches = [self.pool.layer(i) for i in range(cfg.num_layers)]

    def step(self, work):
        """work: (seq_id, ids (n,) or embeds (n, H), positions (3, n) or None). Returns logits per entry."""
        spans, query_lens, context_lens = [], [], []
        for seq_id, x, _ in work:
            n = x.shape[0]
            start = self.pool.allocator.num_tokens(seq_id) if seq_id in self.pool.allocator else None
            assert self.pool.extend(seq_id, n) if start is not None else self.pool.allocate(seq_id, n)
            start = start or 0
            spans.append((seq_id, start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
        seq_ids = [s for s, _, _ in work]
        meta = PagedMetadata.build(query_lens, context_lens, self.pool.block_table(seq_ids), PAGE,
                                   slot_mapping=self.pool.slot_mapping(spans))
        x = torch.cat([x for _, x, _ in work])
        given = [p for _, _, p in work]
        positions = meta.positions if given[0] is None else torch.cat(given, dim=-1)
        inputs = {"input_ids": x} if x.dtype == torch.long else {"inputs_embeds": x}
        with torch.no_grad():
            hidden = self.model(positions, meta, self.caches, **inputs)
            assert hidden.shape == (x.shape[0], self.model.cfg.hidden_size)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))

    def run_schedule(self, seqs: dict, schedule: list[dict]) -> dict:
        """seqs: id -> (x, positions or None); schedule: per step, id -> new tokens (0/absent: idle)."""
        done = {s: 0 for s in seqs}
        out = {s: [] for s in seqs}
        for plan in schedule:
            work = []
            for s, n in plan.items():
                if n:
                    x, pos = seqs[s]
                    work.append((s, x[done[s]:done[s] + n], None if pos is None else pos[:, done[s]:done[s] + n]))
                    done[s] += n
            for (s, _, _), logits in zip(work, self.step(work)):
                out[s].append(logits)
        assert all(done[s] == seqs[s][0].shape[0] for s in seqs), "schedule does not cover the sequences"
        return {s: torch.cat(v) for s, v in out.items()}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed))


def _decode_tail(lengths: dict, plan: list[dict]) -> list[dict]:
    """Append one-token steps for every sequence until each reaches its length."""
    fed = {s: sum(p.get(s, 0) for p in plan) for s in lengths}
    plan = list(plan)
    while any(fed[s] < lengths[s] for s in lengths):
        step = {s: 1 for s in lengths if fed[s] < lengths[s]}
        for s in step:
            fed[s] += 1
        plan.append(step)
    return plan


# Prefix, then chunks of mixed sizes, a late-joining sequence, then decode; several sequences per forward.
LENGTHS = {"a": 23, "b": 11, "c": 30, "d": 9}
SCHEDULE = _decode_tail(LENGTHS, [{"a": 9, "b": 5, "c": 12}, {"a": 6, "b": 1, "c": 7}, {"a": 1, "c": 3, "d": 6}])


# ---- whole prompts --------------------------------------------------------------------------
@pytest.mark.parametrize("name", TEXT + tuple(VARIANTS))
def test_prefill_logits_equal_reference_at_every_position(root, name):
    path = checkpoint(root, name)
    model, cfg = ours(path)
    ref = reference(path, name)
    prompts = {i: _ids(n, seed=n) for i, n in enumerate((1, 7, 16, 41))}
    got = Runner(model, cfg).step([(i, ids, None) for i, ids in prompts.items()])  # one packed forward
    for (i, ids), logits in zip(prompts.items(), got):
        torch.testing.assert_close(logits, reference_logits(ref, name, ids), **TOL)


@pytest.mark.parametrize("name", TEXT + ("qwen2_yarn", "qwen2_sliding", "neox_sequential"))
def test_paged_prefix_chunks_and_decode_equal_full_sequence_logits(root, name):
    path = checkpoint(root, name)
    model, cfg = ours(path)
    ref = reference(path, name)
    seqs = {s: (_ids(n, seed=100 + n), None) for s, n in LENGTHS.items()}
    got = Runner(model, cfg).run_schedule(seqs, SCHEDULE)
    for s, (ids, _) in seqs.items():
        torch.testing.assert_close(got[s], reference_logits(ref, name, ids), **TOL)


# ---- greedy continuation ----------------------------------------------------------------------
@pytest.mark.parametrize("name", TEXT)
def test_greedy_continuation_equals_hf_generate(root, name):
    path = checkpoint(root, name)
    model, cfg = ours(path)
    ref = reference(path, name)
    prompts = {"x": _ids(9, seed=1), "y": _ids(4, seed=2)}
    steps, new = 20, {s: [] for s in prompts}
    runner = Runner(model, cfg)
    work = [(s, ids, None) for s, ids in prompts.items()]
    for _ in range(steps):  # both sequences decode together; the shorter prompt sits in the same batch
        logits = runner.step(work)
        work = []
        for s, rows in zip(prompts, logits):
            token = int(rows[-1].argmax())
            new[s].append(token)
            work.append((s, torch.tensor([token]), None))
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=steps, eos_token_id=None, pad_token_id=0)
    for s, ids in prompts.items():
        want = ref.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            generation_config=config)[0, len(ids):].tolist()
        assert new[s] == want
        assert len(set(want)) > 3, "a degenerate continuation proves little"


# ---- multimodal language models ---------------------------------------------------------------
def _mm_inputs(model, cfg, name: str, length: int, seed: int):
    """Token embeddings with a run of 'image' rows (random vectors) and the matching positions."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embeds = model.embed(_ids(length, seed)).clone()
    start, grid = 3, (1, 4, 6)  # 1 x 2 x 3 merged patches: the three position axes differ
    embeds[start:start + 6] = torch.randn(6, cfg.hidden_size, generator=gen) * 0.5
    if name == "qwen2_audio":
        return embeds, torch.arange(length).expand(3, -1)  # same on every axis: plain RoPE
    positions, _delta = mrope_positions(length, [(start, grid)], spatial_merge=2)
    assert not torch.equal(positions[0], positions[1])
    return embeds, positions


@pytest.mark.parametrize("name", MM)
def test_multimodal_language_model_equals_reference_text_model(root, name):
    path = checkpoint(root, name)
    model, cfg = ours(path)
    ref = reference(path, name)
    assert model.uses_mrope == (name != "qwen2_audio")
    inputs = {i: _mm_inputs(model, cfg, name, n, seed=n) for i, n in enumerate((10, 17, 26))}
    runner = Runner(model, cfg)
    got = runner.step([(i, e, p if model.uses_mrope else None) for i, (e, p) in inputs.items()])
    for (e, p), logits in zip(inputs.values(), got):
        ref_pos = p if model.uses_mrope else p[0]
        torch.testing.assert_close(logits, reference_logits(ref, name, embeds=e, positions=ref_pos), **TOL)
    # Paged: prefix, chunks and decode steps, positions continuing after the image.
    seqs = {s: _mm_inputs(model, cfg, name, n, seed=200 + n) for s, n in LENGTHS.items()}
    seqs = {s: (e, p if model.uses_mrope else None) for s, (e, p) in seqs.items()}
    got = Runner(model, cfg).run_schedule(seqs, SCHEDULE)
    for s, (e, p) in seqs.items():
        pos = p if p is not None else torch.arange(e.shape[0])
        torch.testing.assert_close(got[s], reference_logits(ref, name, embeds=e, positions=pos), **TOL)


def test_mrope_model_takes_1d_positions_for_text(root):
    path = checkpoint(root, "qwen2_vl")
    model, cfg = ours(path)
    ids = _ids(12, seed=5)
    runner = Runner(model, cfg)
    flat = runner.step([("t", ids, None)])[0]  # meta.positions: (T,)
    three = Runner(model, cfg).step([("t", ids, torch.arange(12).expand(3, -1))])[0]
    torch.testing.assert_close(flat, three, atol=0, rtol=0)
    torch.testing.assert_close(flat, reference_logits(reference(path, "qwen2_vl"), "qwen2_vl", embeds=model.embed(ids),
                                                      positions=torch.arange(12).expand(3, -1)), **TOL)


# ---- loading ----------------------------------------------------------------------------------
def _t5_layout(root: Path, name: str) -> Path:
    """The transformers-5 in-memory layout (model.language_model.*, model.visual.*, lm_head.*) of `name`."""
    src = checkpoint(root, name)
    out = root / f"{name}_t5"
    if not out.exists():
        out.mkdir()
        shutil.copy(src / "config.json", out / "config.json")
        state = {k: v.contiguous() for k, v in reference(src, name).state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
    return out


TOWERS = ("visual.", "model.visual.", "audio_tower.", "model.audio_tower.", "multi_modal_projector.",
          "model.multi_modal_projector.")


@pytest.mark.parametrize("name", MM)
def test_both_multimodal_layouts_load_the_same_language_model(root, name):
    hub, t5 = checkpoint(root, name), _t5_layout(root, name)
    t5_keys = CheckpointReader(t5).keys()
    # (transformers 5.0, the floor job's, keeps Qwen2-Audio's hub layout in memory: that job deselects this case)
    assert any(k.startswith("model.language_model.") for k in t5_keys) and "lm_head.weight" in t5_keys
    assert any(k.startswith(TOWERS) for k in t5_keys)
    (a, cfg), (b, _) = ours(hub), ours(t5)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    for path in (hub, t5):
        _, _, report = load_llm(path, device="cpu", dtype=torch.float32, page_size=PAGE)
        assert report.loaded and not any(n.startswith(TOWERS) for n in report.loaded + report.skipped)


@pytest.mark.parametrize("name", ("qwen2_vl", "qwen2_audio"))
def test_tower_shards_are_never_opened(root, name, monkeypatch):
    """Sharded hub checkpoints: load_llm opens no shard that holds only vision / audio tensors."""
    path = root / f"{name}_sharded"
    if not path.exists():
        reference(checkpoint(root, name), name).save_pretrained(path, max_shard_size="20KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tower_only = {path / f for f in set(weight_map.values())
                  if all(k.startswith(TOWERS) for k, g in weight_map.items() if g == f)}
    assert tower_only, "the test means something only if some shards hold only tower tensors"
    readers = []

    class RecordingReader(CheckpointReader):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            readers.append(self)

    monkeypatch.setattr(weights_loader, "CheckpointReader", RecordingReader)
    model, _, report = load_llm(path, device="cpu", dtype=torch.float32, page_size=PAGE)
    assert len(readers) == 1 and readers[0].opened_files
    assert not set(readers[0].opened_files) & tower_only
    assert not any(n.startswith(TOWERS) for n in report.loaded + report.skipped)
    single, _ = ours(checkpoint(root, name))
    for (n, p), (_, q) in zip(model.state_dict().items(), single.state_dict().items()):
        assert torch.equal(p, q), n


def _rewrite(root: Path, name: str, new: str, edit) -> Path:
    src, out = checkpoint(root, name), root / new
    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"))
    return out


def test_an_unexpected_or_missing_tensor_raises(root):
    extra = _rewrite(root, "llama", "llama_extra",
                     lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.ones(2)}))
    with pytest.raises(UnexpectedWeightsError, match="model.layers.0.mlp.extra.weight"):
        ours(extra)
    missing = _rewrite(root, "qwen3", "qwen3_missing", lambda s: s.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(MissingWeightsError, match="model.layers.1.self_attn.k_norm.weight"):
        ours(missing)
    half_qkv = _rewrite(root, "qwen2", "qwen2_no_v", lambda s: s.pop("model.layers.0.self_attn.v_proj.bias"))
    with pytest.raises(MissingWeightsError, match=r"qkv_proj.bias \(shards \['v'\]\)"):
        ours(half_qkv)


def test_neox_legacy_buffers_are_skipped_by_rule(root):
    legacy = {"gpt_neox.layers.0.attention.bias": torch.ones(1, 1, 8, 8, dtype=torch.bool),
              "gpt_neox.layers.0.attention.masked_bias": torch.tensor(-1e9),
              "gpt_neox.layers.1.attention.rotary_emb.inv_freq": torch.ones(2)}
    path = _rewrite(root, "gpt_neox", "neox_legacy", lambda s: s.update(legacy))
    model, cfg, report = load_llm(path, device="cpu", dtype=torch.float32, page_size=PAGE)
    assert sorted(report.skipped) == sorted(legacy)
    ids = _ids(8, seed=3)
    torch.testing.assert_close(Runner(model, cfg).step([(0, ids, None)])[0],
                               reference_logits(reference(checkpoint(root, "gpt_neox"), "gpt_neox"), "gpt_neox", ids),
                               **TOL)


@pytest.mark.parametrize("name", ("qwen3", "gpt_neox", "qwen2_vl"))
def test_dummy_weights_have_the_real_shapes(root, name, tmp_path):
    path = checkpoint(root, name)
    shutil.copy(path / "config.json", tmp_path / "config.json")  # dummy weights need no weight files
    real, _ = ours(path)
    dummy, cfg, report = load_llm(tmp_path, device="cpu", dtype=torch.bfloat16, page_size=PAGE, dummy=True)
    assert report.dummy
    real_params, dummy_params = dict(real.named_parameters()), dict(dummy.named_parameters())
    assert {n: p.shape for n, p in real_params.items()} == {n: p.shape for n, p in dummy_params.items()}
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in dummy_params.values())
    assert not torch.equal(real_params["lm_head.weight"], dummy_params["lm_head.weight"].float())
    pool = build_kv_pool(cfg, "cpu", max_model_len=64, page_size=PAGE, kv_cache_tokens=64, dtype=torch.bfloat16)
    pool.allocate("s", 5)
    meta = PagedMetadata.build([5], [5], pool.block_table(["s"]), PAGE, slot_mapping=pool.slot_mapping([("s", 0, 5)]))
    with torch.no_grad():
        hidden = dummy(meta.positions, meta, [pool.layer(i) for i in range(cfg.num_layers)], input_ids=_ids(5, 0))
    logits = dummy.compute_logits(hidden)
    assert logits.shape == (5, cfg.vocab_size) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


# ---- tensor parallelism ----------------------------------------------------------------------
TP_MODELS = ("qwen2", "llama_bias_tied", "gpt_neox")  # KV heads split / replicated, tied heads, per-head qkv


def _tp_worker(rank: int, world_size: int, cases: list) -> None:
    """Each rank loads its shard of every model from the full checkpoint and reproduces the reference."""
    for path, seqs, want in cases:
        model, cfg, _ = load_llm(path, device="cpu", dtype=torch.float32, page_size=PAGE)
        assert model.lm_head.weight.shape[0] == cfg.vocab_size // world_size
        runner = Runner(model, cfg, tp_size=world_size)
        got = runner.run_schedule({s: (ids, None) for s, ids in seqs.items()}, SCHEDULE)
        for s in seqs:
            torch.testing.assert_close(got[s], want[s], **TOL, msg=lambda m: f"rank {rank} {path}: {m}")


def test_tensor_parallel_ranks_reproduce_the_reference(root):
    cases = []
    for name in TP_MODELS:
        path = checkpoint(root, name)
        seqs = {s: _ids(n, seed=300 + n) for s, n in LENGTHS.items()}
        want = {s: reference_logits(reference(path, name), name, ids) for s, ids in seqs.items()}
        cases.append((str(path), seqs, want))
    distributed.launch(2, _tp_worker, cases, backend="gloo")


# ---- selection and the forward contract -------------------------------------------------------
def model_class(cfg: ModelConfig):
    return pick(cfg, ARCHITECTURES, what="language model")


def test_model_class_by_architecture_and_unknown_architectures(root):
    expected = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                "gpt_neox": GPTNeoXForCausalLM, "qwen2_vl": Qwen2VLTextForCausalLM,
                "qwen2_5_vl": Qwen2_5_VLTextForCausalLM, "qwen2_audio": Qwen2AudioTextForCausalLM}
    for name, cls in expected.items():
        assert model_class(ModelConfig.from_hf(checkpoint(root, name))) is cls
    raw = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2}
    with pytest.raises(ConfigError, match=r"MambaForCausalLM.*supported architectures: .*LlamaForCausalLM"):
        model_class(ModelConfig.from_hf(raw))
    no_arch = ModelConfig.from_hf({**raw, "architectures": None, "model_type": "qwen2"})
    assert model_class(no_arch) is Qwen2ForCausalLM
    dynamic = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                   "vocab_size": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="rope_type 'dynamic' is not supported"), torch.device("meta"):
        model_class(dynamic)(dynamic, selector=AttentionSelector("", platform=Platform.cpu()))


def test_forward_rejects_bad_calls(root):
    model, cfg = ours(checkpoint(root, "qwen2"))
    runner = Runner(model, cfg)
    runner.pool.allocate("s", 4)
    meta = PagedMetadata.build([4], [4], runner.pool.block_table(["s"]), PAGE,
                               slot_mapping=runner.pool.slot_mapping([("s", 0, 4)]))
    ids = _ids(4, 0)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(meta.positions, meta, runner.caches, input_ids=ids, inputs_embeds=model.embed(ids))
    with pytest.raises(ValueError, match=r"positions must be \(4,\)"):
        model(torch.arange(4).expand(3, -1), meta, runner.caches, input_ids=ids)
    with pytest.raises(ValueError, match="KV caches for 2 layers"):
        model(meta.positions, meta, runner.caches[:1], input_ids=ids)
