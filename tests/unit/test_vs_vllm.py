"""benchmarks/vs_vllm.py: the decode-step rule and pdlab's timed steps.

The vLLM side (``vllm_worker.step_times``) needs ``.venv-vllm`` and is exercised by the
benchmark itself; its rows have the same shape and go through the same ``decode_step_s``.
"""

from __future__ import annotations

import pytest

from benchmarks.vs_vllm import PdlabSide, decode_step_s


def test_decode_step_is_the_median_of_full_decode_steps():
    steps = [  # [seconds, tokens, first tokens, finished requests]
        [0.90, 2, 2, 0],  # prefill: both requests' first tokens
        [0.30, 3, 1, 0],  # a third request's first token rides along
        [0.11, 3, 0, 0],
        [0.13, 3, 0, 0],
        [0.12, 3, 0, 0],
        [0.05, 2, 0, 0],  # one row short
        [0.10, 3, 0, 1],  # a request's last token
    ]
    assert decode_step_s(steps, 3) == 0.12
    assert decode_step_s(steps, 2) == 0.05
    with pytest.raises(ValueError, match="no full decode step at B = 4 among 7 steps"):
        decode_step_s(steps, 4)


def test_pdlab_side_times_every_step(tiny):
    side = PdlabSide(tiny, max_model_len=64, max_num_seqs=4)
    steps = side.step_times([[1, 2, 3], [4, 5, 6, 7, 8]], max_tokens=4)
    assert [row[1:] for row in steps] == [[2, 2, 0], [2, 0, 0], [2, 0, 0], [2, 0, 2]]
    assert all(row[0] > 0 for row in steps)
    assert decode_step_s(steps, 2) == (steps[1][0] + steps[2][0]) / 2  # median of two
