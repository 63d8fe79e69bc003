"""``benchmarks.prefix_cache``'s pdlab side of the equal-KV-budget admission check: the peak
of running requests and the preemptions, hand-counted on a KV cache of 4 blocks."""

from __future__ import annotations

from benchmarks import prefix_cache as pc
from experiments.workloads import WorkloadRequest


def three_requests() -> list[WorkloadRequest]:
    # 16-token prompts, 17 output tokens: 16 + 17 - 1 = 32 tokens of KV each at the end
    return [WorkloadRequest(tuple(range(10 + i, 26 + i)), 17, f"hand:{i}") for i in range(3)]


def test_on_demand_admits_all_three_then_preempts_the_newest_once(tiny):
    """64 KV tokens = 4 blocks of 16. Step 1 prefills the three prompts, one block each
    (peak 3). Step 2: each decode needs a second block; a takes the last free one, b finds
    none and preempts the newest running request, c (1 preemption). a and b then fit their
    32 tokens in 2 blocks each and finish at step 17 (outputs 2-17 in steps 2-17); c
    recomputes its 17 tokens at step 18 (output 2) and decodes 15 more: 33 steps."""
    r = pc.pdlab_admission(tiny, three_requests(), kv_tokens=64, block_size=16, max_model_len=64)
    assert (r["kv_blocks"], r["peak_running"], r["num_preemptions"], r["steps"]) == (4, 3, 1, 33)


def test_full_reservation_admits_one_at_a_time(tiny):
    """``--kv-reservation full`` reserves prompt + max_tokens = 33 tokens = 3 of the 4 blocks:
    one request runs at a time (1 prefill + 16 decode steps each: 51), none is preempted."""
    r = pc.pdlab_admission(tiny, three_requests(), kv_tokens=64, block_size=16, max_model_len=64,
                           kv_reservation="full")
    assert (r["kv_blocks"], r["peak_running"], r["num_preemptions"], r["steps"]) == (4, 1, 0, 51)
