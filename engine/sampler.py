"""Logits -> token ids: greedy, temperature, top-k, top-p, each draw seeded by (seed, index).

Greedy rows (``temperature < GREEDY_BELOW_TEMPERATURE``, 1e-5 as vLLM) are one batched
argmax. Sampled rows are filtered in one batch as well (top-k, then top-p on the
temperature-scaled distribution, as transformers' logits warpers do; the most likely token
always survives top-p, so a top_p that is 0 in float32 samples the argmax).

**Placement invariance.** Output token ``i`` of a request with seed ``s`` is drawn with a
fresh ``torch.Generator`` seeded ``draw_seed(s, i)`` (a SplitMix64 mix of the two): the
draw depends on the seed, the token index and the logits alone, never on which process drew
the earlier tokens or what the request was batched with. So a request whose first token
is sampled on a prefill worker and the rest on a decode worker gets exactly the tokens of a
colocated run (no generator state crosses processes, nothing is replayed). An unseeded
request gets a random base seed once per engine (placement invariance needs a seed).

**Isolation.** A sampled row whose probabilities are not finite (NaN or inf logits) fails
alone: ``sample_rows`` reports it in its error map and the engine fails that request; its
step-mates, greedy or sampled, keep their tokens.

**Logprobs.** ``logprobs`` returns, for the rows that asked (``SamplingParams.logprobs``),
the raw log-probabilities: ``log_softmax`` of the model's logits in float32, *before*
temperature, top-k and top-p (vLLM's default ``logprobs_mode="raw_logprobs"``), so they do
not depend on how the token was picked. Other rows cost nothing.
"""

from __future__ import annotations

import random

import torch

from engine.request import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """Seed of output token ``index``'s draw: SplitMix64 (Steele et al. 2014) of
    ``seed * golden + index``, folded to 63 bits (``torch.Generator.manual_seed`` range)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """Samples rows of logits; keeps per request only a draw counter (for callers that do
    not pass token indices) and the base seed of unseeded requests."""

    def __init__(self) -> None:
        self._num_draws: dict[str, int] = {}
        self._random_seeds: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        self._num_draws.pop(request_id, None)
        self._random_seeds.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams], indices: list[int] | None = None) -> list[int]:
        """Pick one token per row (see ``sample_rows``).

        Raises:
            ValueError: some row could not be sampled (the message names its request).
        """
        tokens, errors = self.sample_rows(logits, request_ids, params, indices)
        if errors:
            raise ValueError("; ".join(errors.values()))
        return tokens

    def sample_rows(self, logits: torch.Tensor, request_ids: list[str],
                    params: list[SamplingParams], indices: list[int] | None = None
                    ) -> tuple[list[int | None], dict[int, str]]:
        """Pick one token per row; a row that cannot be sampled gets None and an error.

        Args:
            logits: ``[B, vocab]`` float32.
            request_ids, params: one per row.
            indices: output-token index each row draws (0 = first token); None counts the
                draws of each request id in this sampler (tests, single-engine use).

        Returns:
            (B token ids, None for failed rows; {row: error message}).
        """
        if indices is None:
            indices = [self._next_index(rid) for rid in request_ids]
        tokens: list[int | None] = logits.argmax(dim=-1).tolist()  # greedy rows keep this
        errors: dict[int, str] = {}
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = self._filtered_probs(logits[rows], [params[i] for i in sampled_rows])
            good = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
            for j, i in enumerate(sampled_rows):
                if not good[j]:
                    tokens[i] = None
                    errors[i] = (f"request {request_ids[i]}: sampling failed, probabilities are "
                                 f"not finite (temperature={params[i].temperature}, "
                                 f"top_p={params[i].top_p}, top_k={params[i].top_k})")
                    continue
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(draw_seed(self._seed(request_ids[i], params[i].seed), indices[i]))
                tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen)[0])
        return tokens, errors

    @staticmethod
    def logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int | None],
                 nums: list[int]) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
        """Raw logprobs of some rows: ``log_softmax`` of ``logits`` (float32, before any
        temperature / top-k / top-p filtering, as vLLM's default raw logprobs).

        Args:
            logits: ``[B, vocab]``.
            rows: the rows that asked for logprobs (only these are computed).
            tokens: the sampled token of every row (None: failed, skipped).
            nums: per row of ``rows``, how many top alternatives to return (0..20).

        Returns:
            {row: (sampled token's logprob, ((token_id, logprob), ...) most likely first)}.
        """
        kept = [(r, n) for r, n in zip(rows, nums) if tokens[r] is not None]
        if not kept:
            return {}
        rows, nums = [r for r, _ in kept], [n for _, n in kept]
        index = torch.tensor(rows, device=logits.device)
        lp = torch.log_softmax(logits[index].float(), dim=-1)
        chosen = lp.gather(-1, torch.tensor([[tokens[r]] for r in rows],
                                            device=logits.device))[:, 0].tolist()
        k = min(max(nums), lp.shape[-1])
        if k > 0:
            top_vals, top_ids = lp.topk(k, dim=-1)  # sorted, most likely first
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out = {}
        for j, (r, n) in enumerate(zip(rows, nums)):
            top = tuple(zip(top_ids[j][:n], top_vals[j][:n])) if n > 0 else ()
            out[r] = (chosen[j], top)
        return out

    def _next_index(self, request_id: str) -> int:
        index = self._num_draws.get(request_id, 0)
        self._num_draws[request_id] = index + 1
        return index

    def _seed(self, request_id: str, seed: int | None) -> int:
        if seed is not None:
            return seed
        if request_id not in self._random_seeds:
            self._random_seeds[request_id] = random.getrandbits(63)
        return self._random_seeds[request_id]

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """``[b, vocab]`` probabilities after temperature, top-k and top-p."""
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                             device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p; the most likely token
        # always stays (top_p may be 0 in float32: 1e-46 rounds to 0)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p[:, None]) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)
