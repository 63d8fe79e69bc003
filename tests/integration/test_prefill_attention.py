"""Prompt-chunk attention: the flash paths equal masked attention, and greedy
outputs equal generate() at chunk and length boundaries, chunked and whole, through the
engine and through colocated / disaggregated placements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, reference_generate
from placement_helpers import assert_clean, assert_outputs

from engine import cpu_kernels, ops
from engine import runner as runner_mod
from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from deployment.placement import Deployment

BUDGET = 16
CONTEXT = 256  # the tiny model's max_position_embeddings
# (prompt length, max_tokens): 1, budget - 1, budget, budget + 1, three chunks + 1, and the
# model's full context (prompt + output = 256; 255 + 1 token ends on the last position).
CASES = [(1, 4), (BUDGET - 1, 4), (BUDGET, 4), (BUDGET + 1, 4), (3 * BUDGET + 1, 4),
         (CONTEXT - 4, 4), (CONTEXT - 1, 1)]


@pytest.fixture(scope="module")
def boundary(tiny):
    prompts = random_prompts([n for n, _ in CASES], seed=14)
    requests = lambda: [Request(f"b{i}", tuple(p), SamplingParams(max_tokens=m))  # noqa: E731
                        for i, (p, (_, m)) in enumerate(zip(prompts, CASES))]
    expected = {f"b{i}": reference_generate(tiny.model, p, m)
                for i, (p, (_, m)) in enumerate(zip(prompts, CASES))}
    return requests, expected


def _reference_attention(q, k, v, start):
    """Masked attention over an expanded K/V: q [n, H_q, D], k/v [H_kv, start+n, D]."""
    n, group = q.shape[0], q.shape[1] // k.shape[0]
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 0),
                                         v.repeat_interleave(group, 0), attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("kernel", ["flash", "pdlab", "pdlab512", "reference"],
                         ids=["cpu-flash-lse", "pdlab", "pdlab512", "lower-right-bias"])
@pytest.mark.parametrize("start,n", [(0, 2), (0, 37), (1, 2), (5, 16), (16, 16), (200, 33)])
def test_chunk_attention_equals_masked_attention(tiny, monkeypatch, kernel, start, n):
    kv_store = Engine(tiny, EngineConfig(max_num_seqs=1, max_model_len=8)).kv_store
    if kernel != "reference":  # the CPU backend: flash calls merged by log-sum-exp, or pdlab's
        kernels = cpu_kernels.load()
        if kernel == "pdlab512" and (kernels is None or not kernels.linear_avx512):
            pytest.skip("this CPU has no avx512f")
        if kernel == "pdlab" and (kernels is None or not kernels.linear_vectorized):
            pytest.skip("no C kernels built for AVX2 + FMA here")
        monkeypatch.setenv(ops.FORCE_ENV, f"chunk_attention={kernel}")
    runner = runner_mod.ModelRunner(tiny.model, kv_store)
    if kernel != "reference":
        assert isinstance(runner.ops, ops.CpuOps) and ops.CPU_FLASH is not None
        assert set(runner.ops.chunk_choices.values()) == {kernel}
    else:  # the reference backend (public SDPA; CUDA runs it)
        runner.ops = ops.TorchOps()
    gen = torch.Generator().manual_seed(start * 100 + n)
    q = torch.randn(n, runner.num_heads, runner.head_dim, generator=gen)
    k, v = (torch.randn(runner.num_kv_heads, start + n, runner.head_dim, generator=gen)
            for _ in range(2))
    got = runner._chunk_attention(q, k, v, start)
    assert got.shape == (n, runner.num_heads, runner.head_dim)
    torch.testing.assert_close(got, _reference_attention(q, k, v, start), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunked", [True, False])
def test_engine_greedy_at_chunk_and_length_boundaries(tiny, boundary, chunked):
    requests, expected = boundary
    engine = Engine(tiny, EngineConfig(max_num_seqs=3, max_model_len=CONTEXT,
                                       max_num_batched_tokens=BUDGET if chunked else CONTEXT,
                                       enable_chunked_prefill=chunked))
    assert engine.generate(requests()) == expected
    assert engine.is_empty()


@pytest.mark.parametrize("placement", ["colocated:1", "colocated-nochunk:1", "disagg:1p1d"])
def test_placement_greedy_at_chunk_and_length_boundaries(tiny, boundary, placement):
    requests, expected = boundary
    engine = EngineConfig(max_num_seqs=3, max_model_len=CONTEXT, max_num_batched_tokens=BUDGET)
    workload = [(r, 0.01 * i) for i, r in enumerate(requests())]
    with Deployment(PlacementConfig(placement, "cpu:0,cpu:1"), ModelConfig("tiny-random-llama"),
                    engine, TransferConfig(transport="inprocess", timeout_s=10.0),
                    local=True) as deployment:
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)
        steps = deployment.step_records()
    largest = max(s["num_prefill_tokens"] for s in steps)
    if placement == "colocated-nochunk:1":
        assert largest >= CONTEXT - 4  # the long prompts ran whole
    else:
        assert largest <= BUDGET  # every long prompt was split into chunks


@pytest.mark.slow
def test_smollm2_long_prompts_chunked_match_generate(smollm2):
    """1024 and 2047 prompt tokens at the default budget of 512: later chunks attend to a
    cached prefix of up to 1536 tokens."""
    prompts = random_prompts([1024, 2047], vocab_size=smollm2.model.config.vocab_size, seed=1)
    engine = Engine(smollm2, EngineConfig(max_num_seqs=2, max_model_len=2050,
                                          max_num_batched_tokens=512))
    out = engine.generate([Request(f"s{i}", tuple(p), SamplingParams(max_tokens=3))
                           for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert out[f"s{i}"] == reference_generate(smollm2.model, p, 3)


def _exact_grouping_cost(rows):
    """The exact DP's optimum (every split point), for comparison."""
    best = [0.0] + [float("inf")] * len(rows)
    for j in range(1, len(rows) + 1):
        longest = 0
        for i in range(j - 1, -1, -1):
            longest = max(longest, rows[i][1])
            span = rows[j - 1][0] - rows[i][0] + 1
            best[j] = min(best[j], best[i] + runner_mod._DECODE_CALL_COST_TOKENS + span * longest)
    return best[-1]


def _grouping_cost(runs):
    return sum(runner_mod._DECODE_CALL_COST_TOKENS
               + (run[-1][0] - run[0][0] + 1) * max(r[1] for r in run) for run in runs)


@pytest.mark.parametrize("num_rows", [1, 7, 32, 256])
def test_group_decodes_covers_rows_in_order_near_the_exact_optimum(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    lengths = torch.randint(5, 80, (num_rows,), generator=gen).tolist()
    lengths[: max(1, num_rows // 64)] = [3000] * max(1, num_rows // 64)  # a few long contexts
    rows = [(slot, length, slot) for slot, length in enumerate(lengths)]
    runs = runner_mod._group_decodes(rows)
    assert [row for run in runs for row in run] == rows
    exact = _exact_grouping_cost(rows)
    if num_rows <= runner_mod._GROUP_DP_UNITS:  # every split point is a candidate: exact
        assert _grouping_cost(runs) == exact
    else:  # split points every 8 rows: the long rows still get a run of their own
        assert _grouping_cost(runs) <= 1.1 * exact
        assert max(r[1] for r in runs[-1]) < 3000
