"""Logits -> token ids, in vLLM v1's order (``vllm/v1/sample/sampler.py``) on float32 logits:
min_tokens (EOS and stop ids get -inf); penalties (vLLM's ``apply_penalties``): repetition over
prompt + output (``l / r`` if ``l > 0`` else ``l * r``, bit-equal to vLLM's CUDA kernel), then
``l -= frequency * count_in_output`` and ``l -= presence * (count_in_output > 0)``; greedy rows
take the argmax; sampled rows get temperature, min-p, top-k, top-p, then one draw.

Only rows that ask pay: plain greedy rows are one batched argmax. Placement invariance: output
token ``i`` of a request with seed ``s`` is drawn from a fresh generator seeded ``draw_seed(s,
i)``, so a request sampled partly on a prefill worker and partly on a decode worker gets the tokens
of a colocated run (unseeded: a random base seed per engine). A row with non-finite probabilities
fails alone. ``logprobs`` are the raw ``log_softmax`` before any edit (vLLM's ``raw_logprobs``)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

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


History = tuple[Sequence[int], int]


class Sampler:
    """Samples rows of logits; keeps per request only a draw counter and unseeded base seeds."""

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self._num_draws: dict[str, int] = {}
        self._random_seeds: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        self._num_draws.pop(request_id, None)
        self._random_seeds.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams], indices: list[int] | None = None,
               histories: Sequence[History] | None = None) -> list[int]:
        """Pick one token per row (see ``sample_rows``).

        Raises:
            ValueError: some row could not be sampled (the message names its request)."""
        tokens, errors = self.sample_rows(logits, request_ids, params, indices, histories)
        if errors:
            raise ValueError("; ".join(errors.values()))
        return tokens

    def sample_rows(self, logits: torch.Tensor, request_ids: list[str],
                    params: list[SamplingParams], indices: list[int] | None = None,
                    histories: Sequence[History] | None = None
                    ) -> tuple[list[int | None], dict[int, str]]:
        """Pick one token per row of ``logits`` ``[B, vocab]`` float32 (not modified).
        ``indices``: output-token index each row draws (None counts draws per request id);
        ``histories``: per row (prompt + outputs, prompt length), read for rows with penalties.
        Returns (B token ids, None for failed rows; {row: error message}).

        Raises:
            ValueError: a row with penalties and no history."""
        if indices is None:
            indices = [self._next_index(rid) for rid in request_ids]
        tokens: list[int | None] = logits.argmax(dim=-1).tolist()  # plain greedy rows keep this
        errors: dict[int, str] = {}
        edited_rows = [i for i, p in enumerate(params)
                       if indices[i] < p.min_tokens or p.has_penalties]
        edited = None  # [len(edited_rows), vocab] float32: those rows after steps 1-2
        if edited_rows:
            edited = self.edited_logits(logits, edited_rows, params, indices, histories,
                                         request_ids)
            for i, token in zip(edited_rows, edited.argmax(dim=-1).tolist()):
                tokens[i] = token
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            row_logits = logits.index_select(0, rows).float()  # a copy: the caller's stay
            if edited is not None:
                at = {i: j for j, i in enumerate(edited_rows)}
                pairs = [(k, at[i]) for k, i in enumerate(sampled_rows) if i in at]
                if pairs:
                    dst = torch.tensor([k for k, _ in pairs], device=logits.device)
                    src = torch.tensor([j for _, j in pairs], device=logits.device)
                    row_logits[dst] = edited[src]
            probs = self.distribution(row_logits, [params[i] for i in sampled_rows])
            good = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
            for j, i in enumerate(sampled_rows):
                if not good[j]:
                    tokens[i] = None
                    errors[i] = (f"request {request_ids[i]}: sampling failed, probabilities are "
                                 f"not finite (temperature={params[i].temperature}, "
                                 f"top_p={params[i].top_p}, top_k={params[i].top_k}, "
                                 f"min_p={params[i].min_p})")
                    continue
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(draw_seed(self._seed(request_ids[i], params[i].seed), indices[i]))
                tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen)[0])
        return tokens, errors

    @staticmethod
    def logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int | None],
                 nums: list[int]) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
        """Raw logprobs (``log_softmax``, before any filter) of ``rows`` of ``logits`` ``[B, vocab]``;
        ``nums``: per row how many top alternatives (0..20). Returns {row: (sampled token's
        logprob, ((token_id, logprob), ...) most likely first)}."""
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

    def edited_logits(self, logits: torch.Tensor, rows: list[int],
                       params: list[SamplingParams], indices: list[int],
                       histories: Sequence[History] | None,
                       request_ids: list[str]) -> torch.Tensor:
        """``rows`` after min_tokens and the penalties, a new ``[len(rows), vocab]`` float32.

        Raises:
            ValueError: a row with penalties and ``histories`` None."""
        device = logits.device
        out = logits.index_select(0, torch.tensor(rows, device=device)).float()
        masked = [(j, params[i]) for j, i in enumerate(rows) if indices[i] < params[i].min_tokens]
        if masked:  # 1. EOS and stop ids cannot be drawn yet (vLLM masks EOS even with ignore_eos)
            pos, ids = [], []
            for j, p in masked:
                stop = set(p.stop_token_ids).union(self.eos_token_ids)
                pos += [j] * len(stop)
                ids += sorted(stop)
            if ids:
                out[torch.tensor(pos, device=device), torch.tensor(ids, device=device)] = \
                    float("-inf")
        penalized = [(j, i) for j, i in enumerate(rows) if params[i].has_penalties]
        if penalized and histories is None:
            raise ValueError(f"request {request_ids[penalized[0][1]]}: penalties need the "
                             "token history (histories)")
        if penalized:  # 2. only the tokens seen are touched: O(history), not O(vocab)
            self._penalize(out, penalized, params, histories)
        return out

    @staticmethod
    def _penalize(out: torch.Tensor, penalized: list[tuple[int, int]],
                  params: list[SamplingParams], histories: Sequence[History]) -> None:
        """Penalties in place on rows of ``out`` ``[n, vocab]``: one batch of ops over flat ``row *
        vocab + token`` keys, so cost grows with the histories, not the vocabulary."""
        device, vocab = out.device, out.shape[-1]
        flat = out.view(-1)  # ``out`` is a fresh contiguous copy
        token_ids: list[int] = []
        for _, i in penalized:
            token_ids.extend(histories[i][0])
        lengths = torch.tensor([len(histories[i][0]) for _, i in penalized], device=device)
        starts = torch.cumsum(lengths, 0) - lengths
        row_of = torch.repeat_interleave(torch.tensor([j for j, _ in penalized], device=device),
                                         lengths)
        keys = row_of * vocab + torch.tensor(token_ids, dtype=torch.long, device=device)
        position = torch.arange(len(token_ids), device=device) - torch.repeat_interleave(
            starts, lengths)
        num_prompt = torch.tensor([histories[i][1] for _, i in penalized], device=device)
        is_output = position >= torch.repeat_interleave(num_prompt, lengths)

        def per_row(name: str) -> torch.Tensor:  # [n] float32 by row of ``out``
            values = torch.zeros(out.shape[0], dtype=out.dtype, device=device)
            values[[j for j, _ in penalized]] = torch.tensor(
                [getattr(params[i], name) for _, i in penalized], dtype=out.dtype, device=device)
            return values

        if any(params[i].repetition_penalty != 1.0 for _, i in penalized):  # prompt + output
            seen = torch.unique(keys)
            penalty = per_row("repetition_penalty").index_select(0, seen // vocab)  # 1 = off
            values = flat.index_select(0, seen)
            flat.index_copy_(0, seen, torch.where(values > 0, values / penalty, values * penalty))
        if any(params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0
               for _, i in penalized):  # output only
            seen, counts = torch.unique(keys.masked_select(is_output), return_counts=True)
            row = seen // vocab
            flat.index_copy_(0, seen, flat.index_select(0, seen)
                             - per_row("frequency_penalty").index_select(0, row)
                             * counts.to(out.dtype)
                             - per_row("presence_penalty").index_select(0, row))

    @staticmethod
    def distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """``[b, vocab]`` probabilities of ``logits`` after temperature, min-p, top-k and top-p."""
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps[:, None]
        min_p_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
        if min_p_rows:  # vLLM's MinPLogitsProcessor (= transformers' MinPLogitsWarper)
            index = torch.tensor(min_p_rows, device=logits.device)
            sub = logits[index]
            probs = sub.softmax(dim=-1)
            min_p = torch.tensor([params[j].min_p for j in min_p_rows],
                                 dtype=probs.dtype, device=logits.device)[:, None]
            drop = probs < probs.amax(dim=-1, keepdim=True) * min_p
            logits[index] = sub.masked_fill(drop, float("-inf"))
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                             device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it reaches top_p (top_p may round to 0 in float32)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p[:, None]) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)
