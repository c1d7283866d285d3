"""The sampler against Hugging Face's logits processors; seeded reproducibility; validation."""

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from services.llm.sampling import (
    SamplerRow,
    SamplingParams,
    _min_p,
    _top_k_top_p,
    process_logits,
    sample,
    unpack_logprobs,
)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.7), (8, 0.5), (1, 1.0), (-1, 0.01), (50, 0.95)])
def test_top_k_top_p_mask_equals_hf_warpers(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 3
    ref = logits.clone()
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = _top_k_top_p(logits, torch.full((3,), top_k), torch.full((3,), top_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_repetition_penalty_and_temperature_equal_hf():
    torch.manual_seed(1)
    logits = torch.randn(1, 30) * 2
    prompt = [3, 7, 7, 12]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    row = SamplerRow.create(params, prompt, torch.device("cpu"))
    row.observe(20)
    tokens, _ = sample(logits, [row])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + [20]]), logits.clone())
    assert tokens.item() == ref.argmax().item()
    # Temperature as HF does it (only the ordering matters for greedy, so check the warper on probs).
    warped = TemperatureLogitsWarper(0.5)(None, logits.clone())
    torch.testing.assert_close(warped, logits / 0.5)


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    rows = [SamplerRow.create(SamplingParams(temperature=0.0, logprobs=1), [], torch.device("cpu")) for _ in range(2)]
    tokens, logprobs = sample(logits, rows)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])


def _draw(seed, batch_neighbours, steps=20):
    torch.manual_seed(1234)
    logits = torch.randn(steps, 50)
    row = SamplerRow.create(SamplingParams(temperature=1.0, top_p=0.9, seed=seed), [1, 2], torch.device("cpu"))
    others = [SamplerRow.create(SamplingParams(temperature=0.8), [], torch.device("cpu")) for _ in range(batch_neighbours)]
    out = []
    for t in range(steps):
        batch = torch.cat([logits[t:t + 1], torch.randn(batch_neighbours, 50)])
        tokens, _ = sample(batch, [row, *others])
        out.append(tokens[0].item())
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    a = _draw(seed=7, batch_neighbours=0)
    b = _draw(seed=7, batch_neighbours=5)
    c = _draw(seed=8, batch_neighbours=0)
    assert a == b
    assert a != c
    assert len(set(a)) > 3  # it really samples


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    row = SamplerRow.create(SamplingParams(temperature=1.0, seed=0), [], torch.device("cpu"))
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[sample(logits, [row])[0].item()] += 1
    torch.testing.assert_close(counts / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)
    # top_k=1 leaves only the argmax.
    row_k = SamplerRow.create(SamplingParams(temperature=1.0, top_k=1, seed=0), [], torch.device("cpu"))
    assert {sample(logits, [row_k])[0].item() for _ in range(50)} == {0}


def test_from_proto_defaults_and_validation():
    p = SamplingParams.from_proto(pb.SamplingParams(), default_max_tokens=99, vocab_size=100)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, p.skip_special_tokens) == (1.0, 1.0, -1, 99, None, True)
    p = SamplingParams.from_proto(pb.SamplingParams(temperature=0.0, seed=0, max_tokens=5), default_max_tokens=99,
                                  vocab_size=100)
    assert p.greedy and p.seed == 0 and p.max_tokens == 5
    for bad, match in [
        (pb.SamplingParams(temperature=-1), "temperature"),
        (pb.SamplingParams(top_p=0.0), "top_p"),
        (pb.SamplingParams(top_p=1.5), "top_p"),
        (pb.SamplingParams(top_k=-5), "top_k"),
        (pb.SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (pb.SamplingParams(logprobs=100), "logprobs"),
        (pb.SamplingParams(stop=[""]), "stop strings"),
        (pb.SamplingParams(stop_token_ids=[100]), "outside the vocabulary"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            SamplingParams.from_proto(bad, default_max_tokens=10, vocab_size=100)


# ---- OpenAI's penalties, logit_bias, min_p, min_tokens, top_logprobs --------------------------------------
CPU = torch.device("cpu")


def _force(row, token, vocab=30):
    """One sampling step that must pick `token` (it counts as an output token of the row)."""
    logits = torch.full((1, vocab), -1000.0)  # far beyond any bias or penalty
    logits[0, token] = 1000.0
    assert sample(logits, [row])[0].item() == token


def _reference_openai(logits, output, *, presence, frequency, bias, repetition=1.0, prompt=()):
    """OpenAI's documented formula (logit -= count * frequency + (count > 0) * presence) after logit_bias,
    HF's repetition penalty over prompt + output in between, written out token by token."""
    out = logits.clone().tolist()
    for t, b in bias.items():
        out[t] += b
    for t in set(prompt) | set(output):
        out[t] = out[t] * repetition if out[t] < 0 else out[t] / repetition
    for t in set(output):
        out[t] -= output.count(t) * frequency + presence
    return torch.tensor(out)


@pytest.mark.parametrize("presence, frequency, repetition", [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (-1.0, 1.5, 1.2),
                                                             (2.0, -2.0, 1.0)])
def test_presence_frequency_penalties_and_logit_bias_equal_the_reference(presence, frequency, repetition):
    torch.manual_seed(3)
    vocab, prompt, output = 30, [1, 2, 2, 9], [4, 4, 7, 4, 2]
    bias = {0: 5.0, 4: -3.0, 29: 100.0}
    params = SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition, logit_bias=tuple(sorted(bias.items())))
    row = SamplerRow.create(params, prompt, CPU, vocab_size=vocab)
    for t in output:  # counts live on the device and are updated by sample() itself
        _force(row, t, vocab)
        row.observe(t)  # the repetition penalty's token list, as the engine feeds it
    logits = torch.randn(1, vocab) * 3
    ours = process_logits(logits.clone(), [row])[0]
    ref = _reference_openai(logits[0], output, presence=presence, frequency=frequency, bias=bias,
                            repetition=repetition, prompt=prompt)
    torch.testing.assert_close(ours, ref)
    assert sample(logits, [row])[0].item() == ref.argmax().item()


def test_logit_bias_steers_sampling_and_leaves_other_rows_alone():
    logits = torch.zeros(2, 10)
    biased = SamplerRow.create(SamplingParams(temperature=1.0, seed=0, logit_bias=((3, 100.0),)), [], CPU,
                               vocab_size=10)
    plain = SamplerRow.create(SamplingParams(temperature=0.0), [], CPU)
    logits[1, 6] = 1.0
    for _ in range(20):
        assert sample(logits, [biased, plain])[0].tolist() == [3, 6]


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_mask_equals_hf_warper(min_p):
    from transformers.generation.logits_process import MinPLogitsWarper

    torch.manual_seed(5)
    logits = torch.randn(3, 40) * 3
    ref = MinPLogitsWarper(min_p)(None, logits.clone())
    ours = _min_p(logits, torch.full((3,), min_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    # Sampling under min_p only ever draws tokens HF's warper keeps.
    row = SamplerRow.create(SamplingParams(temperature=1.0, min_p=min_p, seed=1), [], CPU)
    kept = set(torch.nonzero(~torch.isinf(ref[0])).flatten().tolist())
    assert {sample(logits[:1], [row])[0].item() for _ in range(200)} <= kept


def test_min_tokens_bars_eos_and_stop_tokens_until_enough_tokens():
    eos, stop = 7, 3
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop] = 10.0, 9.0
    row = SamplerRow.create(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,)), [], CPU,
                            eos_token_ids=(eos,))
    picks = [sample(logits, [row])[0].item() for _ in range(5)]
    assert picks[:3] == [0, 0, 0] and picks[3:] == [eos, eos]
    ignoring = SamplerRow.create(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=(stop,)),
                                 [], CPU, eos_token_ids=(eos,))
    assert sample(logits, [ignoring])[0].item() == eos  # with ignore_eos, EOS ends nothing: not barred


def test_top_logprobs_are_the_raw_distributions_largest():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    rows = [SamplerRow.create(SamplingParams(temperature=0.0, logprobs=1, top_logprobs=k), [], CPU) for k in (5, 0, 2)]
    tokens, packed = sample(logits, rows)
    ref = logits.log_softmax(-1)
    for i, (row, value) in enumerate(zip(rows, packed.tolist())):
        chosen, top = unpack_logprobs(value, row.params.top_logprobs)
        torch.testing.assert_close(torch.tensor(chosen), ref[i, tokens[i]])
        want = ref[i].topk(row.params.top_logprobs)
        assert [t for t, _ in top] == want.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), want.values)


def test_from_proto_reads_and_checks_the_openai_fields():
    msg = pb.SamplingParams(presence_penalty=0.5, frequency_penalty=-0.5, min_p=0.1, min_tokens=2, logprobs=1,
                            top_logprobs=3, include_stop_str_in_output=True, n=3, max_tokens=5)
    msg.logit_bias[7] = 2.5
    p = SamplingParams.from_proto(msg, default_max_tokens=10, vocab_size=100)
    assert (p.presence_penalty, p.frequency_penalty, p.min_p, p.min_tokens, p.top_logprobs, p.n) == (
        0.5, -0.5, pytest.approx(0.1), 2, 3, 3)
    assert p.logit_bias == ((7, 2.5),) and p.include_stop_str_in_output
    choice = pb.SamplingParams(structured=pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", "b"])))
    assert SamplingParams.from_proto(choice, default_max_tokens=10, vocab_size=100).structured.spec == ("a", "b")
    for kwargs, bias, match in [
        (dict(presence_penalty=2.5), {}, "presence_penalty"),
        (dict(frequency_penalty=-3), {}, "frequency_penalty"),
        ({}, {100: 1.0}, "logit_bias token ids"),
        ({}, {1: 101.0}, "logit_bias values"),
        (dict(min_p=1.5), {}, "min_p"),
        (dict(min_tokens=6, max_tokens=5), {}, "min_tokens"),
        (dict(top_logprobs=3), {}, "top_logprobs needs logprobs"),
        (dict(logprobs=1, top_logprobs=21), {}, "top_logprobs"),
        (dict(n=17), {}, "n must be"),
        (dict(ignore_eos=True, structured=pb.StructuredOutput(regex="a+")), {}, "ignore_eos"),
        (dict(structured=pb.StructuredOutput()), {}, "structured"),
        (dict(structured=pb.StructuredOutput(choice=pb.ChoiceList())), {}, "choice"),
    ]:
        bad = pb.SamplingParams(**kwargs)
        for t, b in bias.items():
            bad.logit_bias[t] = b
        with pytest.raises(InvalidArgument, match=match):
            SamplingParams.from_proto(bad, default_max_tokens=10, vocab_size=100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_openai_fields_on_cuda_equal_the_cpu():
    torch.manual_seed(9)
    logits = torch.randn(4, 64) * 2
    eos = 5

    def rows(device):
        made = [
            SamplerRow.create(SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5,
                                             logit_bias=((3, 4.0), (7, -9.0)), logprobs=1, top_logprobs=4), [1, 2],
                              device, vocab_size=64),
            SamplerRow.create(SamplingParams(temperature=0.0, min_tokens=2), [], device, eos_token_ids=(eos,)),
            SamplerRow.create(SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=-1.0), [9],
                              device, vocab_size=64),
            SamplerRow.create(SamplingParams(temperature=0.0, logprobs=1), [], device),
        ]
        return made

    out = {}
    for device in (torch.device("cpu"), torch.device("cuda")):
        rs, picks = rows(device), []
        for step in range(4):
            tokens, lp = sample((logits + step).to(device), rs)
            picks.append((tokens.tolist(), lp.cpu()))
            for r, t in zip(rs, tokens.tolist()):
                r.observe(t)
        out[device.type] = picks
    for (cpu_t, cpu_lp), (cuda_t, cuda_lp) in zip(out["cpu"], out["cuda"]):
        assert cpu_t == cuda_t
        torch.testing.assert_close(cpu_lp, cuda_lp, atol=1e-4, rtol=1e-4)
