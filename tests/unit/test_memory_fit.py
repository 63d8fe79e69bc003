"""The memory-fit refusal: weights per device from a geometry (published parameter counts
reproduced), split by TP and PP, plus the minimum KV, against a device's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.memory_fit import Geometry, check_fits

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
H100 = 80 * GIB
LLAMA_70B = Geometry(hidden=8192, num_heads=64, num_kv_heads=8, head_dim=128, intermediate=28672,
                     num_layers=80, vocab=128256, tied=False)


def geometry(name: str) -> Geometry:
    return Geometry.from_config(json.loads((ROOT / "engine/configs" / name / "config.json").read_text()))


def test_published_parameter_counts():
    assert geometry("llama-3.1-8b").params() == 8_030_261_248
    assert geometry("qwen2.5-7b").params() == 7_615_616_512  # Q/K/V biases included
    assert LLAMA_70B.params() == 70_553_706_496


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_ranks_of_a_layer_add_up_to_the_layer_with_norms_replicated(tp):
    g = geometry("llama-3.1-8b")
    assert tp * g.layer_params(tp) == g.layer_params(1) + (tp - 1) * 2 * g.hidden
    # one device's share at TP 8 with the head split: a layer's eighth plus its norms
    assert g.device_params(tp, vocab_parallel=True) == (
        g.num_layers * g.layer_params(tp) + 2 * g.vocab * g.hidden // tp + g.hidden)


def test_kv_heads_replicate_past_their_count():
    g = Geometry(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128,
                 num_layers=2, vocab=256, tied=False)
    assert g.kv_bytes_per_token(4, tp=1) == 2 * 2 * 2 * 16 * 4
    assert g.kv_bytes_per_token(4, tp=2) == g.kv_bytes_per_token(4, tp=4) == 2 * 2 * 1 * 16 * 4
    assert g.kv_bytes_per_token(4, tp=1, pp=2) == 2 * 1 * 2 * 16 * 4


def test_pipeline_stages_hold_their_layers_and_one_table():
    g = LLAMA_70B
    table = g.vocab * g.hidden
    assert g.device_params(1, 4) == 20 * g.layer_params() + table + g.hidden
    assert g.device_params(2, 3) == 27 * g.layer_params(2) + table + g.hidden  # ceil(80 / 3)


def test_llama_70b_bf16_on_h100s():
    """TP 1 (141 GB of weights) is refused in one line; TP 2 fits at 0.9 of 80 GiB with a
    replicated head (69.6 GiB of weights) and more room with a split one; TP 4 fits with room."""
    with pytest.raises(ValueError) as info:
        check_fits(LLAMA_70B, 2, 1, 1, H100, 1024, 0.9, what="prefill", device="an H100")
    assert str(info.value) == ("prefill at TP 1, PP 1 does not fit an H100: 131 GiB of weights "
                               "+ 0.312 GiB of KV for 1024 tokens > 72 GiB (0.9 of 80 GiB)")
    replicated = check_fits(LLAMA_70B, 2, 2, 1, H100, 1024, 0.9)
    split = check_fits(LLAMA_70B, 2, 2, 1, H100, 1024, 0.9, vocab_parallel=True)
    assert split - replicated == LLAMA_70B.vocab * LLAMA_70B.hidden * 2  # half of 2 tables, bf16
    assert check_fits(LLAMA_70B, 2, 4, 1, H100, 1024, 0.9) > 35 * GIB
    with pytest.raises(ValueError, match="KV for 100000 tokens"):
        check_fits(LLAMA_70B, 2, 2, 1, H100, 100_000, 0.9)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="TP 3 does not suit"):
        LLAMA_70B.device_params(3)
    with pytest.raises(ValueError, match=r"PP 81 must be in \[1, 80\]"):
        LLAMA_70B.device_params(1, 81)
