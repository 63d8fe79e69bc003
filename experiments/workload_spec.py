"""What a command replays, checked before anything starts: ``WorkloadSpec`` (dataset, size,
lengths, seeds, the arrival process; its fields are the workload options of ``run``,
``compare``, ``bench`` and ``plan``), the requests it draws for a model (clipped or refused
to fit the model's context, with one message), and those requests with arrival offsets as
the router replays them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.arrivals import PROCESSES, arrival_times
from engine.config import EngineConfig, ModelConfig, check_fields
from engine.model import TINY_NAMES, load_tokenizer, model_context_len, tiny_llama_config
from engine.request import Request, SamplingParams
from experiments import workloads


DATASETS = ("sharegpt", "humaneval", "synthetic")


LENGTHS = r"\d+(-\d+)?"  # synthetic lengths: N or lo-hi tokens


@dataclass(frozen=True)
class WorkloadSpec:
    """What to replay: dataset, size, lengths, and the arrival process (DESIGN §6).

    Attributes:
        dataset: ``sharegpt``, ``humaneval`` or ``synthetic``.
        num_requests: requests per (placement, rate, seed) run.
        seed: the first workload and arrival seed (the same for every placement).
        seeds: repeats of every (placement, rate): seeds ``seed .. seed + seeds - 1``, each
            drawing its own requests and arrival times.
        arrival: ``poisson``, ``gamma`` or ``burst``; burstiness: Gamma shape (1 = Poisson).
        min_prompt_len, max_prompt_len: ShareGPT prompt-length filter in tokens (the default
            keeps prompts long enough that a prefill visibly stalls colocated decodes).
        max_output_len: ShareGPT/HumanEval output cap in tokens.
        calibrate: pick the rates from a short calibration (``calibrated_rates``) instead
            of the given ones.
        prompt_len, output_len: synthetic lengths, ``N`` or ``lo-hi`` (uniform).
    """

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

    def __post_init__(self) -> None:
        check_fields(self)
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
        return None

    @property
    def seed_list(self) -> list[int]:
        return [self.seed + i for i in range(self.seeds)]

    def options(self) -> dict:
        """The options that apply to this dataset and arrival process (for the config row)."""
        keys = ["dataset", "num_requests", "seed", "seeds", "arrival", "calibrate"]
        keys += ["burstiness"] if self.arrival == "gamma" else []
        keys += {"sharegpt": ["min_prompt_len", "max_prompt_len", "max_output_len"],
                 "humaneval": ["max_output_len"],
                 "synthetic": ["prompt_len", "output_len"]}[self.dataset]
        return {k: getattr(self, k) for k in keys}


def _bounds(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _length_range(text: str) -> int | tuple[int, int]:
    lo, _, hi = text.partition("-")
    return (int(lo), int(hi)) if hi else int(lo)


def context_len(model: ModelConfig, engine: EngineConfig) -> int:
    """Tokens one request may use (prompt + output), known before any model loads: the
    engine's ``max_model_len``, capped by the model's context where a config file tells it
    (``engine.model.model_context_len``; otherwise the workers' own limit is checked once
    they are deployed)."""
    model_len = model_context_len(model)
    return engine.max_model_len if model_len is None else min(engine.max_model_len, model_len)


def build_workload(spec: WorkloadSpec, model: ModelConfig, seed: int | None = None,
                   max_len: int | None = None) -> list[workloads.WorkloadRequest]:
    """The requests of ``spec`` drawn with ``seed`` (default ``spec.seed``), each fitting
    ``max_len`` tokens (prompt + output) when given: ShareGPT and HumanEval outputs are
    clipped to fit (see ``fit_workload``); synthetic lengths are refused up front. Arrival
    times are set per rate later.

    Raises:
        ValueError: a synthetic length range or a prompt that cannot fit ``max_len``.
    """
    seed = spec.seed if seed is None else seed
    if spec.dataset == "synthetic":
        prompt, output = _length_range(spec.prompt_len), _length_range(spec.output_len)
        if max_len is not None:
            check_synthetic_fits(prompt, output, max_len, model.model)
        vocab = tiny_llama_config().vocab_size if model.model in TINY_NAMES else 49152
        return workloads.synthetic(spec.num_requests, seed, prompt, output, vocab_size=vocab,
                                   token_range=(3, vocab))
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"model {model.model} has no tokenizer: use --dataset synthetic")
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
        ValueError: naming the options, the model's context and lengths that would fit.
    """
    p_hi = prompt[1] if isinstance(prompt, tuple) else prompt
    o_hi = output[1] if isinstance(output, tuple) else output
    if p_hi + o_hi > max_len:
        raise ValueError(
            f"prompt_len up to {p_hi} + output_len up to {o_hi} = {p_hi + o_hi} tokens does not "
            f"fit {model_name}'s context of {max_len} tokens (max_model_len); choose e.g. "
            f"--prompt-len 8-{max(1, max_len - o_hi)} or a shorter --output-len")


def fit_workload(items: list[workloads.WorkloadRequest], max_len: int, model_name: str
                 ) -> list[workloads.WorkloadRequest]:
    """Clip each output so prompt + output fits ``max_len`` tokens; prints one line saying
    how many were clipped.

    Raises:
        ValueError: a prompt alone leaves no room for one output token.
    """
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
    item's output length and ``ignore_eos``, so each produces exactly that many tokens."""
    return [Request(f"{tag}-{i}", it.prompt_token_ids,
                    SamplingParams(max_tokens=it.output_len, ignore_eos=True))
            for i, it in enumerate(items)]


def router_workload(items: list[workloads.WorkloadRequest], rate: float, spec: WorkloadSpec,
                    tag: str, seed: int | None = None) -> list[tuple[Request, float]]:
    """Requests with arrival offsets at ``rate`` req/s drawn with ``seed`` (default
    ``spec.seed``); ``ignore_eos`` so each produces exactly its reference output length."""
    seed = spec.seed if seed is None else seed
    offsets = arrival_times(len(items), rate, seed, spec.arrival, spec.burstiness)
    return list(zip(requests_of(items, tag), (float(t) for t in offsets)))
