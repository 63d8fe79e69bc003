"""Logits -> token ids: greedy, temperature, top-k, top-p, one seeded generator per request.

Greedy rows are one batched argmax. Sampled rows are filtered in one batch as well (top-k,
then top-p on the temperature-scaled distribution, as transformers' logits warpers do);
each row then draws with its own ``torch.Generator`` so a request's output depends on its
seed alone, not on what it was batched with.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams


class Sampler:
    """Keeps one ``torch.Generator`` per sampled request, created from its seed."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        """Pick one token per row.

        Args:
            logits: ``[B, vocab]`` float32.
            request_ids, params: one per row.

        Returns:
            B token ids.
        """
        tokens = logits.argmax(dim=-1)  # [B]; greedy rows keep this
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            probs = self._filtered_probs(logits[rows], [params[i] for i in sampled_rows])
            for j, i in enumerate(sampled_rows):
                gen = self._generator(request_ids[i], params[i].seed, logits.device)
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return tokens.tolist()

    def _generator(self, request_id: str, seed: int | None, device) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed) if seed is not None else gen.seed()
            self._generators[request_id] = gen
        return gen

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
        # drop a token when the mass before it already reaches top_p (the first always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)
