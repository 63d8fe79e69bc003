"""Sampler: greedy, top-k, top-p, min-p, min_tokens, penalties, per-request seeded generators
independent of the batch."""

from __future__ import annotations

import collections

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import Sampler


def rand_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_per_row():
    logits = rand_logits(6, 50)
    tokens = Sampler().sample(logits, [f"r{i}" for i in range(6)], [SamplingParams()] * 6)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert len(set(tokens)) > 1  # the rows really differ


def test_greedy_rows_unaffected_by_sampled_rows_in_the_same_batch():
    logits = rand_logits(4, 50, seed=1)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(),
              SamplingParams(temperature=2.0, seed=2)]
    tokens = Sampler().sample(logits, ["a", "b", "c", "d"], params)
    argmax = logits.argmax(dim=-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    assert all(0 <= t < 50 for t in tokens)


def test_top_k_1_at_temperature_1_is_argmax():
    logits = rand_logits(5, 64, seed=2)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(5)]
    sampler = Sampler()
    for _ in range(10):
        assert sampler.sample(logits, [f"r{i}" for i in range(5)], params) == \
            logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_argmax():
    logits = rand_logits(5, 64, seed=3)
    params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(5)]
    sampler = Sampler()
    for _ in range(10):
        assert sampler.sample(logits, [f"r{i}" for i in range(5)], params) == \
            logits.argmax(dim=-1).tolist()


def draws(seed: int, num: int = 12, vocab: int = 100, request_id: str = "r") -> list[int]:
    sampler = Sampler()
    flat = torch.zeros(1, vocab)
    params = [SamplingParams(temperature=1.0, seed=seed)]
    return [sampler.sample(flat, [request_id], params)[0] for _ in range(num)]


def test_same_seed_same_tokens_different_seed_differs():
    a, b = draws(seed=123), draws(seed=123)
    assert a == b
    assert len(set(a)) > 3  # a flat distribution really is sampled, not argmax'd
    assert draws(seed=124) != a
    assert draws(seed=123, request_id="other") == a  # the seed, not the id, decides


def test_draws_do_not_depend_on_batch_companions():
    vocab = 40
    target = rand_logits(1, vocab, seed=4)[0] / 3  # a moderately flat row
    p_target = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=77)
    s1, s2 = Sampler(), Sampler()
    seq1, seq2 = [], []
    for step in range(8):
        # batch 1: the target alone with one sampled companion
        other = rand_logits(1, vocab, seed=100 + step)
        logits1 = torch.stack([target, other[0]])
        seq1.append(s1.sample(logits1, ["t", "x"],
                              [p_target, SamplingParams(temperature=0.7, seed=5)])[0])
        # batch 2: greedy and differently sampled rows around it, in another position
        others = rand_logits(3, vocab, seed=200 + step)
        logits2 = torch.stack([others[0], others[1], target, others[2]])
        params2 = [SamplingParams(), SamplingParams(temperature=1.3, top_k=5, seed=9),
                   p_target, SamplingParams(temperature=0.2, top_p=0.5, seed=11)]
        seq2.append(s2.sample(logits2, ["g", "y", "t", "z"], params2)[2])
    assert seq1 == seq2
    assert len(set(seq1)) > 1


def test_forget_restarts_the_stream():
    sampler = Sampler()
    flat = torch.zeros(1, 100)
    params = [SamplingParams(temperature=1.0, seed=5)]
    first = [sampler.sample(flat, ["r"], params)[0] for _ in range(5)]
    sampler.forget("r")
    again = [sampler.sample(flat, ["r"], params)[0] for _ in range(5)]
    assert first == again


def test_top_k_3_never_samples_outside_top_3():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9, 0.0, 2.8, 2.7, 1.0]])  # top 3: 1, 3, 5
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, top_k=3, seed=0)]
    seen = collections.Counter(sampler.sample(logits, ["r"], params)[0] for _ in range(200))
    assert set(seen) == {1, 3, 5}  # all three appear; nothing else (6 is a close 4th)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=1)]
    seen = collections.Counter(sampler.sample(probs.log(), ["r"], params)[0] for _ in range(300))
    assert set(seen) == {0, 1}  # 0.5 < 0.7, so 1 is needed; 0.5 + 0.3 >= 0.7 stops there
    assert 0.5 < seen[0] / 300 < 0.75  # renormalized: 0.5 / 0.8 = 0.625


def test_frequencies_match_softmax_at_temperature_1():
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.5]])
    expected = logits.softmax(dim=-1)[0].tolist()  # ~ [0.43, 0.16, 0.10, 0.26]
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, seed=2024)]
    n = 4000
    counts = collections.Counter(sampler.sample(logits, ["r"], params)[0] for _ in range(n))
    for token, p in enumerate(expected):
        assert abs(counts[token] / n - p) < 0.03, (token, counts[token] / n, p)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.5]])
    sampler = Sampler()
    params = [SamplingParams(temperature=0.05, seed=3)]
    seen = collections.Counter(sampler.sample(logits, ["r"], params)[0] for _ in range(200))
    assert seen[0] == 200  # exp(-0.5 / 0.05) ~ 5e-5 for the runner-up


# ---- one bad request never fails its step-mates; draws depend on (seed, index) only -------

def test_temperature_and_top_p_that_are_zero_in_float32_do_not_yield_nan():
    logits = rand_logits(3, 64, seed=5)
    params = [SamplingParams(),  # greedy step-mate
              SamplingParams(temperature=1e-46, seed=1),  # below 1e-5: greedy
              SamplingParams(temperature=1.0, top_p=1e-46, seed=2)]  # top_p is 0 in float32
    assert torch.tensor([1e-46]).item() == 0.0
    assert params[1].is_greedy and not params[2].is_greedy
    tokens, errors = Sampler().sample_rows(logits, ["g", "t", "p"], params)
    assert errors == {} and tokens == logits.argmax(dim=-1).tolist()


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = rand_logits(3, 32, seed=6)
    logits[1, 4] = float("nan")
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.8, seed=2)]
    tokens, errors = Sampler().sample_rows(logits, ["g", "bad", "ok"], params)
    assert list(errors) == [1] and "request bad: sampling failed" in errors[1]
    assert tokens[0] == logits[0].argmax().item() and tokens[1] is None
    assert tokens[2] == Sampler().sample(logits[2:], ["ok"], params[2:])[0]


def test_draw_of_token_i_does_not_depend_on_who_drew_earlier_tokens():
    flat = torch.zeros(1, 1000)
    params = [SamplingParams(temperature=1.0, seed=123)]
    whole = [Sampler().sample(flat, ["r"], params, [i])[0] for i in range(6)]
    one = Sampler()  # one process draws every token, in order
    assert [one.sample(flat, ["r"], params)[0] for _ in range(6)] == whole
    prefill, decode = Sampler(), Sampler()  # token 0 on one worker, the rest on another
    split = prefill.sample(flat, ["r"], params, [0]) + \
        [decode.sample(flat, ["r"], params, [i])[0] for i in range(1, 6)]
    assert split == whole and len(set(whole)) == 6


def test_logprobs_are_raw_log_softmax_of_the_asking_rows_only():
    """Raw logprobs: log_softmax of the logits before temperature / top-k / top-p; only the
    rows that asked are computed; the top list is sorted, most likely first."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7, top_k=3, seed=1, logprobs=4),
              SamplingParams(), SamplingParams(logprobs=0)]
    tokens = Sampler().sample(logits, ["a", "b", "c"], params)
    out = Sampler.logprobs(logits, [0, 2], tokens, [4, 0])
    assert set(out) == {0, 2}
    want = torch.log_softmax(logits, dim=-1)
    for row in (0, 2):
        value, top = out[row]
        assert abs(value - float(want[row, tokens[row]])) < 1e-6
        assert len(top) == (4 if row == 0 else 0)
    values, ids = want[0].topk(4)
    assert [t for t, _ in out[0][1]] == ids.tolist()
    assert [v for _, v in out[0][1]] == sorted((v for _, v in out[0][1]), reverse=True)
    assert max(abs(v - w) for (_, v), w in zip(out[0][1], values.tolist())) < 1e-6
    assert Sampler.logprobs(logits, [1], [None, None, None], [3]) == {}  # failed rows skipped


# ---- vLLM's extensions: min_tokens, penalties, min-p, top_k -1 -------------------

def hf_processors():
    from transformers.generation.logits_process import (MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper)
    return RepetitionPenaltyLogitsProcessor, MinPLogitsWarper, TemperatureLogitsWarper


def test_repetition_penalty_is_transformers_processor_bit_for_bit():
    """Over prompt + output (transformers passes generate()'s whole input_ids, prompt
    included; vLLM ORs its prompt and output masks): the same float32 values exactly."""
    repetition, _, _ = hf_processors()
    logits = rand_logits(3, 64, seed=7)  # both signs, and one exact 0 below
    logits[0, 9] = 0.0
    histories = [([9, 1, 2, 2, 40], 3), ([5, 6], 2), ([63, 0, 17, 17, 5, 33], 1)]
    for penalty in (1.3, 0.7):
        params = [SamplingParams(repetition_penalty=penalty)] * 3
        got = Sampler().edited_logits(logits, [0, 1, 2], params, [2, 0, 5], histories, list("abc"))
        for row, (ids, _) in enumerate(histories):
            want = repetition(penalty)(torch.tensor([ids]), logits[row:row + 1].clone())
            assert torch.equal(got[row], want[0]), (penalty, row)
        assert not torch.equal(got, logits)  # it really changed something
    assert logits[0, 9] == 0.0  # the caller's logits are not edited


def test_presence_and_frequency_penalties_count_output_tokens_only():
    """OpenAI's definition (vLLM's): l -= frequency * count_in_output + presence * [count > 0];
    the prompt's tokens are not penalized by either, only by the repetition penalty."""
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0]])
    history = [([0, 1, 2, 2, 3], 2)]  # prompt [0, 1], output [2, 2, 3]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    got = Sampler().edited_logits(logits, [0], params, [3], history, ["r"])
    assert got[0].tolist() == [1.0, 2.0, 0.5 - 0.5 - 0.5, -1.0 - 0.25 - 0.5, 0.0]
    both = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    got = Sampler().edited_logits(logits, [0], both, [3], history, ["r"])  # repetition first
    assert got[0].tolist() == [0.5, 1.0, 0.25 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 0.0]
    negative = [SamplingParams(presence_penalty=-1.0, frequency_penalty=-2.0)]  # favour repeats
    got = Sampler().edited_logits(logits, [0], negative, [3], history, ["r"])
    assert got[0].tolist() == [1.0, 2.0, 0.5 + 4.0 + 1.0, -1.0 + 2.0 + 1.0, 0.0]


def test_penalized_greedy_row_picks_the_penalized_argmax_and_spares_its_step_mates():
    logits = torch.tensor([[3.0, 2.9, 0.0, 1.0],
                           [3.0, 2.9, 0.0, 1.0],
                           [3.0, 2.9, 0.0, 1.0]])
    params = [SamplingParams(), SamplingParams(frequency_penalty=0.2),
              SamplingParams(temperature=1.0, top_k=1, seed=3)]
    histories = [([0, 0], 1), ([1, 0], 1), ([0], 1)]  # row 1 has output token 0 once
    tokens = Sampler().sample(logits, ["g", "p", "s"], params, [1, 1, 0], histories)
    assert tokens == [0, 1, 0]  # 3.0 - 0.2 < 2.9; the plain rows keep the argmax
    # rows without penalties need no history at all
    assert Sampler().sample(logits[:2], ["g", "s"], [params[0], params[2]], [0, 0]) == [0, 0]
    with pytest.raises(ValueError, match="request p: penalties need the token history"):
        Sampler().sample(logits, ["g", "p", "s"], params, [1, 1, 0])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    """vLLM's MinTokensLogitsProcessor: EOS (even with ignore_eos) and the stop ids are -inf
    while the request has fewer than min_tokens outputs (the index being drawn)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 0.5, 4.0]])  # EOS 3 first, stop id 5 second
    sampler = Sampler(eos_token_ids=(3,))
    p = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(5,))
    assert [sampler.sample(logits, ["r"], [p], [i])[0] for i in range(4)] == [2, 2, 3, 3]
    ignoring = SamplingParams(max_tokens=8, min_tokens=1, ignore_eos=True)
    assert sampler.sample(logits, ["r"], [ignoring], [0]) == [5]  # EOS still masked
    masked = sampler.edited_logits(logits, [0], [p], [0], None, ["r"])
    assert masked[0].tolist() == [0.0, 1.0, 2.0, float("-inf"), 0.5, float("-inf")]
    seen = {sampler.sample(logits, ["s"], [SamplingParams(
        max_tokens=8, min_tokens=3, temperature=1.0, seed=seed, stop_token_ids=(5,))], [2])[0]
        for seed in range(300)}
    assert seen == {0, 1, 2, 4}  # sampled rows are masked too


def test_min_p_keeps_transformers_min_p_warper_survivors():
    _, min_p_warper, temperature_warper = hf_processors()
    logits = rand_logits(4, 80, seed=8)
    for min_p, temperature in ((0.05, 1.0), (0.3, 0.7), (1.0, 1.3)):
        params = [SamplingParams(temperature=temperature, min_p=min_p)] * 4
        kept = Sampler.distribution(logits.clone(), params) > 0
        scaled = temperature_warper(temperature)(None, logits.clone())
        want = torch.isfinite(min_p_warper(min_p)(None, scaled))
        assert torch.equal(kept, want), (min_p, temperature)
        assert 0 < int(want.sum()) < 4 * 80
    assert torch.equal(Sampler.distribution(logits.clone(), [SamplingParams(temperature=1.0)] * 4),
                       logits.softmax(dim=-1))  # min_p 0: off


def test_min_p_runs_before_top_p_as_vllm():
    """vLLM applies min-p before top-k / top-p: [0.5, 0.3, 0.2] with min_p 0.5 drops 0.2
    (< 0.25), renormalizes to [0.625, 0.375], and top_p 0.6 then keeps token 0 alone (the
    other order would keep {0, 1})."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    p = SamplingParams(temperature=1.0, min_p=0.5, top_p=0.6, seed=4)
    sampler = Sampler()
    assert {sampler.sample(logits, ["r"], [p])[0] for _ in range(100)} == {0}
    q = SamplingParams(temperature=1.0, min_p=0.5, seed=4)
    seen = collections.Counter(sampler.sample(logits, ["q"], [q])[0] for _ in range(400))
    assert set(seen) == {0, 1} and 0.55 < seen[0] / 400 < 0.7  # 0.625


def test_top_k_minus_one_is_off():
    logits = rand_logits(1, 30, seed=9) / 3
    off, minus_one = SamplingParams(temperature=1.0, seed=6), SamplingParams(temperature=1.0,
                                                                           top_k=-1, seed=6)
    assert minus_one.top_k == 0
    assert torch.equal(Sampler.distribution(logits.clone(), [minus_one]), logits.softmax(dim=-1))
    assert draws(6) == [Sampler().sample(torch.zeros(1, 100), ["r"], [minus_one], [i])[0]
                        for i in range(12)]
    assert off == minus_one


def test_penalized_draws_depend_on_history_and_index_only():
    """A penalized, seeded request sampled token by token gives the same tokens whether one
    sampler draws them all or the first comes from another process (the history, prompt +
    outputs, is what both hold)."""
    vocab, prompt = 20, [3, 4, 4, 9]
    logits = rand_logits(1, vocab, seed=10) / 4
    p = SamplingParams(temperature=1.0, seed=42, repetition_penalty=1.8, frequency_penalty=0.7,
                       presence_penalty=0.3, min_p=0.02, max_tokens=10, min_tokens=3)

    def run(samplers):
        tokens = []
        for i in range(10):
            sampler = samplers[min(i, len(samplers) - 1)]
            history = [(prompt + tokens, len(prompt))]
            tokens += sampler.sample(logits, ["r"], [p], [i], history)
        return tokens

    whole = run([Sampler(eos_token_ids=(0,))])
    assert run([Sampler(eos_token_ids=(0,)), Sampler(eos_token_ids=(0,))]) == whole
    plain = SamplingParams(temperature=1.0, seed=42)
    unpenalized = [Sampler().sample(logits, ["r"], [plain], [i])[0] for i in range(10)]
    assert whole != unpenalized  # the penalties really took part


def test_penalties_of_several_rows_in_one_call_are_each_rows_own():
    """The penalized rows are edited in one batch: each row must get its own penalties and
    history, exactly as when edited alone (rows without penalties stay as they came)."""
    logits = rand_logits(4, 50, seed=11)
    histories = [([1, 2, 3, 3], 2), ([4, 4, 5], 1), ([7], 1), ([2, 9, 9, 9, 1], 2)]
    params = [SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3),
              SamplingParams(presence_penalty=-0.7), SamplingParams(),
              SamplingParams(repetition_penalty=0.6, presence_penalty=1.1)]
    indices = [2, 2, 0, 3]
    together = Sampler().edited_logits(logits, [0, 1, 2, 3], params, indices, histories, list("abcd"))
    for row in range(4):
        alone = Sampler().edited_logits(logits, [row], params, indices, histories, list("abcd"))
        assert torch.equal(together[row], alone[0]), row
    assert torch.equal(together[2], logits[2])
    assert all(not torch.equal(together[r], logits[r]) for r in (0, 1, 3))
