"""`pdlab interference` bookkeeping on a stub engine whose clock advances by known step times.

The stub runs pdlab's real Scheduler (so chunking, budgets and admission are the engine's),
but its "forward" only advances a fake clock by ``A + B_COST * decode tokens + C_COST *
prefill tokens`` and its KV copy (``finish_remote``, outside the step, as in the Engine)
by ``D_COST * tokens``. Every inflation, stall and fitted coefficient below is then known
by hand.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest

from engine.kv_cache import KVSpec
from engine.request import RequestState, RequestStatus
from engine.scheduler import Scheduler
from experiments import plots
from experiments.commands import interference as itf

# binary fractions: sums of them are exact in floating point
A, B_COST, C_COST, D_COST = 2.0 ** -6, 2.0 ** -8, 2.0 ** -12, 2.0 ** -14
GRID = itf.InterferenceConfig(batch_sizes="1,4", prompt_lens="0,20,50", context_len=8,
                              chunk_budgets="16,36")
REPEATS = 2


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class StubEngine:
    """The Engine methods ``measure_mode`` uses, over the real Scheduler, with a fake clock."""

    def __init__(self, config, clock: FakeClock) -> None:
        self.config, self.clock = config, clock
        self.scheduler = Scheduler(config)
        self.states: dict[str, RequestState] = {}
        self.step_records = []
        self.kv_spec = KVSpec("stub", num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")

    def _write(self, block_ids, kv) -> None:
        self.clock.now_s += D_COST * kv.shape[3]

    def add_request(self, request) -> None:
        state = RequestState(request)
        self.states[request.request_id] = state
        self.scheduler.add(state)

    def add_remote(self, request, first_token) -> None:
        state = RequestState(request)
        state.token_ids.append(first_token)
        state.num_computed_tokens = request.num_prompt_tokens
        state.first_output_index = 1
        state.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.states[request.request_id] = state
        self.scheduler.add(state)

    def finish_remote(self, request_id, kv) -> None:  # as Engine: copy in, then decode
        self._write(None, kv)
        self.scheduler.kv_arrived(self.states[request_id])

    def step(self):
        batch = self.scheduler.schedule()
        prefill = batch.num_prefill_tokens
        decode = batch.num_tokens - prefill
        self.clock.now_s += A + B_COST * decode + C_COST * prefill
        sampled = {i: 7 for i in range(len(batch.requests)) if batch.completes(i)}
        produced = self.scheduler.update(batch, sampled)
        for state in produced:
            if state.status.is_finished:
                self.states.pop(state.request_id)
        self.step_records.append(SimpleNamespace(num_prefill_tokens=prefill,
                                                 num_decode_tokens=decode))
        return [SimpleNamespace(request_id=s.request_id) for s in produced]

    def abort(self, request_id) -> None:
        state = self.states.pop(request_id)
        self.scheduler.release(state)


@pytest.fixture(scope="module")
def measured():
    clock = FakeClock()
    steps, imports = [], []
    for mode, budget in GRID.modes():
        for b in GRID.batch_sizes_t:
            engine = StubEngine(itf.engine_config(GRID, mode, budget, b, REPEATS, "cpu"), clock)
            s, i = itf.measure_mode(engine, GRID, mode, budget, b, REPEATS, vocab_size=100,
                                    clock=clock)
            assert engine.states == {} and engine.scheduler.capacity.num_used_blocks == 0
            steps += s
            imports += i
    return pd.DataFrame(steps), pd.DataFrame(imports)


def _row(summary, mode, b, p, budget=None):
    sel = summary[(summary["mode"] == mode) & (summary["batch_size"] == b)
                  & (summary["prompt_len"] == p)]
    if budget is not None:
        sel = sel[sel["budget"] == budget]
    assert len(sel) == 1
    return sel.iloc[0]


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("p", [20, 50])
def test_whole_prompt_stalls_by_its_prefill_time(measured, b, p):
    summary = itf.summarize(*measured)
    base = A + B_COST * b
    row = _row(summary, itf.NOCHUNK, b, p)
    assert row.base_step_s == pytest.approx(base, rel=1e-12)
    assert row.worst_step_s == pytest.approx(base + C_COST * p, rel=1e-12)
    assert row.stall_s == pytest.approx(C_COST * p, rel=1e-9)
    assert row.inflation == pytest.approx((base + C_COST * p) / base, rel=1e-12)
    assert row.num_injection_steps == 1 and math.isnan(row.import_s)


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("p", [20, 50])
@pytest.mark.parametrize("k", [16, 36])
def test_chunking_bounds_each_step_by_the_budget(measured, b, p, k):
    summary = itf.summarize(*measured)
    base = A + B_COST * b
    chunk = min(k - b, p)  # decodes take one token each, the chunk the rest of the budget
    row = _row(summary, itf.CHUNKED, b, p, budget=k)
    assert row.num_injection_steps == math.ceil(p / (k - b))
    assert row.stall_s == pytest.approx(C_COST * chunk, rel=1e-9)
    assert row.inflation == pytest.approx((base + C_COST * chunk) / base, rel=1e-12)
    assert row.total_stall_s == pytest.approx(C_COST * p, rel=1e-9)  # the same work, spread


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("p", [20, 50])
def test_disagg_stalls_by_one_more_decode_and_the_import(measured, b, p):
    summary = itf.summarize(*measured)
    row = _row(summary, itf.DISAGG, b, p)
    assert row.num_injection_steps == 1
    # as the real Engine: the KV is copied in before the step (finish_remote), so the step
    # pays one more decode row and the copy is reported on its own
    assert row.stall_s == pytest.approx(B_COST, rel=1e-9)
    assert row.import_s == pytest.approx(D_COST * p, rel=1e-12)


def test_no_prefill_row_is_the_baseline(measured):
    summary = itf.summarize(*measured)
    for mode, budget in GRID.modes():
        row = _row(summary, mode, 4, 0, budget)
        assert row.inflation == 1.0 and row.stall_s == 0.0 and row.num_injection_steps == 0


def test_step_model_fit_recovers_the_stub_costs(measured):
    fits = itf.fit_step_model(measured[0])
    assert set(fits) == {"colocated-nochunk", "chunked-K16", "chunked-K36", "disagg"}
    for name in ("colocated-nochunk", "chunked-K16", "chunked-K36"):
        fit = fits[name]
        assert (fit.a, fit.b, fit.c) == pytest.approx((A, B_COST, C_COST), rel=1e-6)
        assert fit.r2 == pytest.approx(1.0)
    # disagg: P counts imported KV tokens, copied in before the step, so the step's c is 0
    assert (fits["disagg"].a, fits["disagg"].b) == pytest.approx((A, B_COST), rel=1e-6)
    assert fits["disagg"].c == pytest.approx(0.0, abs=1e-12)


def test_sentence_quotes_the_largest_point(measured):
    text = itf.sentence(itf.summarize(*measured), "stub")
    base = A + B_COST * 4
    assert text.startswith(f"On this device (stub), a 50-token prefill stalls a 4-request "
                           f"decode batch by {C_COST * 50 * 1e3:.3g} ms "
                           f"({(base + C_COST * 50) / base:.2f}x")
    assert f"chunking at budget 16 reduces that to {C_COST * 12 * 1e3:.3g} ms per step" in text
    # ceil(50 / (16 - 4)) steps, each stalled by its chunk's tokens: 50 tokens' worth in all
    assert f"over 5 steps ({C_COST * 50 * 1e3:.3g} ms in all)" in text
    assert f"disaggregation to {B_COST * 1e3:.3g} ms" in text
    assert f"{D_COST * 50 * 1e3:.3g} ms." in text


def test_heatmap_is_written(measured, tmp_path):
    plots.plot_heatmap(itf.summarize(*measured), tmp_path / "h.png", "stub", itf.mode_label)
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kwargs,words", [
    ({"prompt_lens": "0"}, "prompt_lens must hold a length > 0"),
    ({"chunk_budgets": "4", "batch_sizes": "1,4"}, "chunk_budgets must each be > the largest"),
    ({"batch_sizes": "0,4"}, "batch_sizes must be like"),
    ({"context_len": 1}, "context_len must be >= 2"),
])
def test_bad_grid_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        itf.InterferenceConfig(**kwargs)


def test_quick_grid_replaces_the_grid():
    grid = itf.InterferenceConfig(quick=True).grid()
    assert (grid.batch_sizes_t, grid.prompt_lens_t, grid.context_len, grid.chunk_budgets_t) \
        == ((1, 2), (0, 16, 48), 16, (12,))


def _steps(mode, budget, repeats):
    """Hand-made steps.csv rows of one cell: ``repeats`` = [(baseline, [injection steps])]."""
    rows = []
    for r, (base_s, inj) in enumerate(repeats):
        cell = {"mode": mode, "budget": budget, "batch_size": 4, "prompt_len": 64, "repeat": r}
        rows.append({**cell, "kind": "baseline", "step_s": base_s})
        rows += [{**cell, "kind": "injection", "step_s": s} for s in inj]
    return pd.DataFrame(rows)


def test_every_figure_of_a_cell_comes_from_the_median_stall_repeat():
    # stalls 2/64, -6/64 (repeat 1: its baseline disturbed) and 5/64: the median is repeat 0's.
    # The minimum of each figure taken alone would give base 8/64 (repeat 0), worst 9/64
    # (repeat 1), stall 1/64 and total stall -6/64 (repeat 1): figures of no single repeat
    u = 2.0 ** -6
    steps = _steps(itf.NOCHUNK, None, [(8 * u, [10 * u]), (15 * u, [9 * u]), (11 * u, [16 * u])])
    row = itf.summarize(steps).iloc[0]
    assert (row.base_step_s, row.worst_step_s) == (8 * u, 10 * u)
    assert row.stall_s == row.total_stall_s == 2 * u  # one injection step: the same figure
    assert row.inflation == 10 / 8 and row.num_injection_steps == 1


def test_chunked_total_stall_is_the_sum_over_the_chosen_repeats_steps():
    u = 2.0 ** -6
    # repeat 0: stall 3u, total (3 + 1 + 2)u; repeat 1: stall 1u (disturbed baseline), total
    # (1 - 2 - 1)u; repeat 2: stall 7u, total (7 + 5 + 6)u. Median stall: repeat 0.
    steps = _steps(itf.CHUNKED, 16, [(4 * u, [7 * u, 5 * u, 6 * u]),
                                     (8 * u, [9 * u, 6 * u, 7 * u]),
                                     (4 * u, [11 * u, 9 * u, 10 * u])])
    row = itf.summarize(steps).iloc[0]
    assert (row.base_step_s, row.worst_step_s, row.stall_s) == (4 * u, 7 * u, 3 * u)
    assert row.total_stall_s == 6 * u and row.num_injection_steps == 3


def test_two_repeats_report_the_lower_stall_and_ties_the_smaller_base():
    u = 2.0 ** -6
    row = itf.summarize(_steps(itf.DISAGG, None, [(4 * u, [9 * u]), (5 * u, [6 * u])])).iloc[0]
    assert (row.base_step_s, row.worst_step_s, row.stall_s) == (5 * u, 6 * u, 1 * u)
    tie = itf.summarize(_steps(itf.DISAGG, None, [(5 * u, [6 * u]), (4 * u, [5 * u])])).iloc[0]
    assert (tie.base_step_s, tie.stall_s, tie.total_stall_s) == (4 * u, 1 * u, 1 * u)
