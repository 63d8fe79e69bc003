"""What a command replays, checked before anything starts: ``WorkloadSpec`` (the workload options
of ``run``, ``compare``, ``bench`` and ``plan``), the requests it draws for a model (clipped or
refused to fit its context, with one message), and their arrival offsets. Datasets: ``sharegpt``,
``humaneval``, ``synthetic``, ``prefix_repetition`` (vLLM's shape) at ``--rates``; ``mooncake``
(``--trace FILE`` at its own timestamps); ``multiturn`` (closed loop: conversations/s, later turns
``--think-time-s`` after the previous answer; ``MultiTurn`` / ``ClosedLoop``)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.arrivals import PROCESSES, arrival_times
from engine.config import EngineConfig, ModelConfig, check_fields
from engine.model import TINY_NAMES, load_tokenizer, model_context_len, tiny_llama_config
from engine.request import Request, SamplingParams
from experiments import workloads


DATASETS = ("sharegpt", "humaneval", "synthetic", "prefix_repetition", "multiturn", "mooncake")


LENGTHS = r"\d+(-\d+)?"  # synthetic lengths: N or lo-hi tokens
PATH = r"[\w./~+-][\w./~+ -]*"  # a file path (no shell metacharacters)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to replay; each field's ``help`` and bounds are its CLI option's. ``num_requests``:
    per (placement, rate, seed) run (``multiturn``: conversations; ``mooncake``: first lines);
    seeds ``seed .. seed + seeds - 1`` each draw their own requests and arrivals, the same for
    every placement; ``trace_time_scale_s``: seconds per timestamp unit (Mooncake's ms: 0.001)."""

    dataset: str = field(default="sharegpt", metadata={"choices": DATASETS})
    num_requests: int = field(default=24, metadata={"help": "requests per rate", "min": 1})
    seed: int = field(default=0, metadata={"help": "workload and arrival seed", "min": 0})
    seeds: int = field(default=2, metadata={
        "help": "repeats per (placement, rate), seeds seed, seed+1, ...; the summary reports "
                "means and 95%% bootstrap intervals over them", "min": 1})
    arrival: str = field(default="poisson", metadata={"choices": PROCESSES})
    burstiness: float = field(default=1.0, metadata={"help": "Gamma shape; 1 = Poisson", "gt": 0})
    min_prompt_len: int = field(default=128, metadata={"help": "sharegpt: shortest prompt kept",
                                                       "min": 1})
    max_prompt_len: int = field(default=1024, metadata={"help": "sharegpt: longest prompt kept",
                                                        "min": 1})
    max_output_len: int = field(default=48, metadata={
        "help": "sharegpt/humaneval: output length cap (tokens)", "min": 1})
    calibrate: bool = field(default=False, metadata={
        "help": "replace --rates by a ladder around the capacity measured on the first "
                "placement (a burst of the seed's requests): 0.5x, 1.5x and 4x of it; and "
                "loosen an SLO that even a lone request misses on this machine "
                "(to 4x its TTFT, 2x its TPOT)"})
    prompt_len: str = field(default="32-512", metadata={
        "help": "synthetic only: N or lo-hi tokens", "pattern": LENGTHS, "hint": "N or lo-hi"})
    output_len: str = field(default="16-64", metadata={
        "help": "synthetic only: N or lo-hi tokens", "pattern": LENGTHS, "hint": "N or lo-hi"})
    num_prefixes: int = field(default=4, metadata={
        "help": "prefix_repetition: system prompts shared by the questions", "min": 1})
    prefix_len: int = field(default=256, metadata={
        "help": "prefix_repetition: tokens per system prompt", "min": 1})
    suffix_len: int = field(default=64, metadata={
        "help": "prefix_repetition: tokens per question", "min": 1})
    max_turns: int = field(default=4, metadata={
        "help": "multiturn: turns kept per conversation", "min": 2})
    think_time_s: float = field(default=1.0, metadata={
        "help": "multiturn: mean think time between an answer and the next turn (s)",
        "min": 0})
    trace: str | None = field(default=None, metadata={
        "help": "mooncake: the trace file (JSON lines: timestamp, input_length, "
                "output_length, hash_ids)", "pattern": PATH, "hint": "a file path"})
    trace_block_tokens: int = field(default=512, metadata={
        "help": "mooncake: tokens per hash id", "min": 1})
    trace_time_scale_s: float = field(default=0.001, metadata={
        "help": "mooncake: seconds per timestamp unit", "gt": 0})

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.dataset == "mooncake") != (self.trace is not None):
            raise ValueError("trace must be given with --dataset mooncake (and only then), "
                             f"got dataset {self.dataset!r}, trace {self.trace!r}")
        if self.trace is not None:  # read it now: a bad line is refused before anything starts
            if not os.path.isfile(self.trace):
                raise ValueError(f"trace must be an existing file, got {self.trace!r}")
            try:
                workloads.read_mooncake_trace(self.trace, self.trace_block_tokens)
            except ValueError as err:
                raise ValueError(f"trace {err}") from None
        if self.dataset == "prefix_repetition" and self.num_prefixes > self.num_requests:
            raise ValueError(f"num_prefixes must be <= num_requests ({self.num_requests}), "
                             f"got {self.num_prefixes}")
        if self.max_prompt_len < self.min_prompt_len:
            raise ValueError(f"max_prompt_len must be >= min_prompt_len ({self.min_prompt_len}), "
                             f"got {self.max_prompt_len}")
        for name in ("prompt_len", "output_len"):
            lo, hi = _bounds(getattr(self, name))
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be N or lo-hi with 1 <= lo <= hi, "
                                 f"got {getattr(self, name)!r}")

    def max_request_len(self) -> int | None:
        """The longest prompt + output this workload can ask for (None: humaneval, unknown)."""
        if self.dataset == "synthetic":
            return _bounds(self.prompt_len)[1] + _bounds(self.output_len)[1]
        if self.dataset == "sharegpt":
            return self.max_prompt_len + self.max_output_len
        if self.dataset == "prefix_repetition":
            return self.prefix_len + self.suffix_len + self.max_output_len
        return None

    @property
    def rate_unit(self) -> str:
        """``conversations/s`` for ``multiturn``, else ``req/s``."""
        return "conversations/s" if self.dataset == "multiturn" else "req/s"

    @property
    def seed_list(self) -> list[int]:
        return [self.seed + i for i in range(self.seeds)]

    def options(self) -> dict:
        """The options that apply to this dataset and arrival process (for the config row)."""
        keys = ["dataset", "num_requests", "seed", "seeds", "arrival", "calibrate"]
        keys += ["burstiness"] if self.arrival == "gamma" else []
        keys += {"sharegpt": ["min_prompt_len", "max_prompt_len", "max_output_len"],
                 "humaneval": ["max_output_len"],
                 "synthetic": ["prompt_len", "output_len"],
                 "prefix_repetition": ["num_prefixes", "prefix_len", "suffix_len",
                                       "max_output_len"],
                 "multiturn": ["max_turns", "think_time_s", "max_output_len"],
                 "mooncake": ["trace", "trace_block_tokens", "trace_time_scale_s"]
                 }[self.dataset]
        return {k: getattr(self, k) for k in keys}


def _bounds(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _length_range(text: str) -> int | tuple[int, int]:
    lo, _, hi = text.partition("-")
    return (int(lo), int(hi)) if hi else int(lo)


def context_len(model: ModelConfig, engine: EngineConfig) -> int:
    """Tokens one request may use: ``max_model_len``, capped by the model's context where its
    config tells it (else the workers check once deployed)."""
    model_len = model_context_len(model)
    return engine.max_model_len if model_len is None else min(engine.max_model_len, model_len)


def build_workload(spec: WorkloadSpec, model: ModelConfig, seed: int | None = None,
                   max_len: int | None = None) -> list[workloads.WorkloadRequest]:
    """The requests of ``spec`` drawn with ``seed`` (default ``spec.seed``), each fitting
    ``max_len`` tokens (prompt + output) when given: ShareGPT and HumanEval outputs are clipped to
    fit (see ``fit_workload``); synthetic lengths are refused up front. Arrival times are set per
    rate later.

    Raises:
        ValueError: a synthetic length range or a prompt that cannot fit ``max_len``."""
    seed = spec.seed if seed is None else seed
    vocab = tiny_llama_config().vocab_size if model.model in TINY_NAMES else 49152
    if spec.dataset == "synthetic":
        prompt, output = _length_range(spec.prompt_len), _length_range(spec.output_len)
        if max_len is not None:
            check_synthetic_fits(prompt, output, max_len, model.model)
        return workloads.synthetic(spec.num_requests, seed, prompt, output, vocab_size=vocab,
                                   token_range=(3, vocab))
    if spec.dataset == "prefix_repetition":
        if max_len is not None:
            check_synthetic_fits(spec.prefix_len + spec.suffix_len, spec.max_output_len,
                                 max_len, model.model)
        return workloads.prefix_repetition(spec.num_requests, seed, spec.num_prefixes,
                                           spec.prefix_len, spec.suffix_len, spec.max_output_len,
                                           vocab_size=vocab, token_range=(3, vocab))
    if spec.dataset == "mooncake":
        items = workloads.mooncake_trace(spec.trace, seed, spec.num_requests,
                                         spec.trace_block_tokens, spec.trace_time_scale_s,
                                         vocab_size=vocab, token_range=(3, vocab))
        return Timed(fit_workload(items, max_len, model.model) if max_len else items)
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"model {model.model} has no tokenizer: use --dataset synthetic, "
                         "prefix_repetition or mooncake (random token ids)")
    if spec.dataset == "multiturn":
        return MultiTurn(workloads.sharegpt_conversations(
            tokenizer, spec.num_requests, seed, min_turns=2, max_turns=spec.max_turns,
            max_output_len=spec.max_output_len, max_total_len=max_len,
            mean_think_time_s=spec.think_time_s))
    if spec.dataset == "sharegpt":
        return workloads.sharegpt(tokenizer, spec.num_requests, seed,
                                  min_prompt_len=spec.min_prompt_len,
                                  max_prompt_len=min(spec.max_prompt_len, max_len - 1)
                                  if max_len else spec.max_prompt_len,
                                  max_output_len=spec.max_output_len, max_total_len=max_len)
    items = workloads.humaneval(tokenizer, spec.num_requests, seed,
                                max_output_len=spec.max_output_len)
    return fit_workload(items, max_len, model.model) if max_len else items


def check_synthetic_fits(prompt: int | tuple[int, int], output: int | tuple[int, int],
                         max_len: int, model_name: str) -> None:
    """Refuse synthetic lengths whose longest prompt + output exceeds ``max_len`` tokens.

    Raises:
        ValueError: naming the options, the model's context and lengths that would fit."""
    p_hi = prompt[1] if isinstance(prompt, tuple) else prompt
    o_hi = output[1] if isinstance(output, tuple) else output
    if p_hi + o_hi > max_len:
        raise ValueError(
            f"prompt_len up to {p_hi} + output_len up to {o_hi} = {p_hi + o_hi} tokens does not "
            f"fit {model_name}'s context of {max_len} tokens (max_model_len); choose e.g. "
            f"--prompt-len 8-{max(1, max_len - o_hi)} or a shorter --output-len")


def fit_workload(items: list[workloads.WorkloadRequest], max_len: int, model_name: str
                 ) -> list[workloads.WorkloadRequest]:
    """Clip each output so prompt + output fits ``max_len`` tokens; prints one line saying how many
    were clipped.

    Raises:
        ValueError: a prompt alone leaves no room for one output token."""
    too_long = [it for it in items if it.num_prompt_tokens >= max_len]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) of up to "
                         f"{max(it.num_prompt_tokens for it in too_long)} tokens do not fit "
                         f"{model_name}'s context of {max_len} tokens (max_model_len)")
    out = [dataclasses.replace(it, output_len=min(it.output_len, max_len - it.num_prompt_tokens))
           for it in items]
    clipped = sum(a.output_len != b.output_len for a, b in zip(items, out))
    if clipped:
        print(f"pdlab: clipped the output of {clipped} request(s) to fit {model_name}'s "
              f"context of {max_len} tokens", file=sys.stderr)
    return out


def requests_of(items: Sequence[workloads.WorkloadRequest], tag: str) -> list[Request]:
    """The requests of ``items`` as a run sends them: ids ``<tag>-<i>``, ``max_tokens`` the
    item's output length and ``ignore_eos``, so each produces exactly that many tokens. For
    a ``MultiTurn`` workload: a ``MultiTurnRequests`` (its planned turns, and ``open`` for
    the closed-loop replay the simulator runs)."""
    if isinstance(items, MultiTurn):
        return MultiTurnRequests(items, tag)
    requests = [_request(f"{tag}-{i}", it) for i, it in enumerate(items)]
    return TimedRequests(requests, [it.arrival_s for it in items]) if isinstance(
        items, Timed) else requests


def _request(request_id: str, item: workloads.WorkloadRequest) -> Request:
    return Request(request_id, item.prompt_token_ids,
                   SamplingParams(max_tokens=item.output_len, ignore_eos=True))


def router_workload(items: list[workloads.WorkloadRequest], rate: float, spec: WorkloadSpec,
                    tag: str, seed: int | None = None) -> list[tuple[Request, float]]:
    """Requests with arrival offsets at ``rate`` req/s drawn with ``seed`` (default
    ``spec.seed``); ``ignore_eos`` so each produces exactly its reference output length.
    A ``mooncake`` trace keeps its own offsets (``rate`` does not apply); a ``MultiTurn``
    workload gives a ``ClosedLoop`` (its conversations start at ``rate``/s)."""
    seed = spec.seed if seed is None else seed
    if isinstance(items, MultiTurn):
        return MultiTurnRequests(items, tag).open(rate, seed, spec.arrival, spec.burstiness)
    if isinstance(items, Timed):
        return requests_of(items, tag).open(rate, seed)
    offsets = arrival_times(len(items), rate, seed, spec.arrival, spec.burstiness)
    return list(zip(requests_of(items, tag), (float(t) for t in offsets)))


class Timed(list):
    """Workload requests that carry their own arrival offsets (a trace): no rate applies."""


def trace_rate(items: Sequence[workloads.WorkloadRequest]) -> float:
    """The mean arrival rate of a trace's requests (req/s): ``(n - 1)`` gaps over the span from the
    first arrival to the last (``arrival_s``); ``n`` when every request arrives at once (or there is
    one). What ``pdlab plan`` labels a trace's single run with, since ``--rates`` do not apply to
    it.

    Raises:
        ValueError: no requests."""
    if not items:
        raise ValueError("a trace needs at least one request")
    times = [it.arrival_s for it in items]
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else float(len(times))


class TimedRequests(list):
    """The ``Request``s of a ``Timed`` workload; ``open`` pairs them with their offsets
    (whatever the rate: the trace's timing)."""

    def __init__(self, requests: Sequence[Request], offsets_s: Sequence[float]) -> None:
        super().__init__(requests)
        self.offsets_s = [float(t) for t in offsets_s]

    def open(self, rate: float, seed: int, process: str = "poisson",
             burstiness: float = 1.0) -> list[tuple[Request, float]]:
        return list(zip(self, self.offsets_s))


class MultiTurn(list):
    """A multi-turn workload: ``conversations`` (``workloads.Conversation``), and as list
    elements every turn *as planned* (a ``WorkloadRequest`` whose history holds
    placeholder answers of the turn's ``output_len`` tokens): what lengths, context checks,
    the planner's rate ladder and a warm-up read. A replay sends the real turns, each built
    from the answers really generated (``router_workload`` -> ``ClosedLoop``)."""

    def __init__(self, conversations: Sequence[workloads.Conversation]) -> None:
        self.conversations = tuple(conversations)
        super().__init__(conv.turn_request(k, history) for conv in self.conversations
                         for k, history in enumerate(_planned_histories(conv)))


class MultiTurnRequests(list):
    """The planned turns of a ``MultiTurn`` as ``Request``s (ids ``<tag>-c<i>-t<k>``), and
    ``open``: the closed-loop replay of its conversations."""

    def __init__(self, items: MultiTurn, tag: str) -> None:
        self.conversations, self.tag = items.conversations, tag
        super().__init__(_request(f"{tag}-c{c}-t{k}", conv.turn_request(k, history))
                         for c, conv in enumerate(items.conversations)
                         for k, history in enumerate(_planned_histories(conv)))

    def open(self, rate: float, seed: int, process: str = "poisson",
             burstiness: float = 1.0) -> ClosedLoop:
        """A fresh ``ClosedLoop`` whose conversations start at ``rate`` conversations/s
        (``engine.arrivals.arrival_times`` with ``seed``)."""
        return ClosedLoop(workloads.with_conversation_arrivals(
            self.conversations, rate, seed, process, burstiness), self.tag)


def _planned_histories(conv: workloads.Conversation) -> list[tuple[int, ...]]:
    """Each turn's history as planned: the turns before it, each answered by its
    ``output_len`` copies of its prompt's last token (placeholders)."""
    out: list[tuple[int, ...]] = []
    history: tuple[int, ...] = ()
    for k, turn in enumerate(conv.turns):
        out.append(history)
        prompt = conv.turn_request(k, history).prompt_token_ids
        history = prompt + (prompt[-1],) * turn.output_len
    return out


class ClosedLoop(list):
    """A closed-loop replay (``Router.run`` and ``planner.simulate.Simulator.run`` accept
    it): the list holds ``(request, arrival offset s)`` of every conversation's first turn;
    ``follow(record, end_s)`` is called when a request ended (its ``RequestRecord``, the
    replay's clock in s) and returns the next turn of its conversation, built from the
    tokens it really generated (``workloads.ConversationReplay``, whose timing rule is
    ``engine.arrivals.Chains``), or nothing. Use a fresh one per run."""

    def __init__(self, conversations: Sequence[workloads.Conversation], tag: str) -> None:
        self.replay = workloads.ConversationReplay(conversations)
        index = {c.conversation_id: i for i, c in enumerate(conversations)}
        self._id = lambda item: f"{tag}-c{index[item.conversation_id]}-t{item.turn}"
        self._items: dict[str, workloads.WorkloadRequest] = {}
        super().__init__(self._add(item) for item in self.replay.first_turns())

    def _add(self, item: workloads.WorkloadRequest) -> tuple[Request, float]:
        request = _request(self._id(item), item)
        self._items[request.request_id] = item
        return request, item.arrival_s

    def follow(self, record, end_s: float, output_token_ids=None) -> list[tuple[Request, float]]:
        """The next turn after ``record`` (``engine.metrics.RequestRecord``) ended at ``end_s``, its
        history holding ``output_token_ids`` (default: the record's; the simulator passes its
        placeholder tokens): [] when its conversation is over (or the turn failed: the rest is
        dropped, ``replay.num_dropped``).

        Raises:
            KeyError: ``record`` is not a turn of this replay."""
        item = self._items.pop(record.request_id)
        outputs = tuple(record.output_token_ids if output_token_ids is None else output_token_ids)
        ok = record.error is None and len(outputs) == item.output_len
        nxt = self.replay.next_turn(item, outputs if ok else None, end_s)
        return [] if nxt is None else [self._add(nxt)]
