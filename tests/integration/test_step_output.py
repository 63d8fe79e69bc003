"""One step, one output: ``Engine.step`` reports its tokens, finished,
failed and reserved requests in its ``StepOutput``, and its ``StepRecord`` keeps the batch
that ran, checked against batches worked out by hand from the scheduler's rules."""

from __future__ import annotations

import io

import pandas as pd
import torch
from conftest import random_prompts, reference_generate

from engine.config import EngineConfig
from engine.engine import Engine, FailedRequest
from engine.metrics import BatchEntry, StepRecord, parse_batch
from engine.request import FinishReason, Request, SamplingParams

P, D = "prefill", "decode"


def test_two_chunked_prompts_leave_the_batches_worked_out_by_hand(tiny):
    # budget 8: a (10 tokens) runs 8, then its last 2 beside all 6 of b; then both decode
    # (a after 10 computed tokens, b after 6), a stops at max_tokens=2; then b alone (7).
    prompts = random_prompts([10, 6], seed=31)
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=64,
                                       max_num_batched_tokens=8), quiet=True)
    engine.add_request(Request("a", tuple(prompts[0]), SamplingParams(max_tokens=2,
                                                                      ignore_eos=True)))
    engine.add_request(Request("b", tuple(prompts[1]), SamplingParams(max_tokens=3,
                                                                      ignore_eos=True)))
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    assert [s.record.batch for s in steps] == [
        (BatchEntry("a", 8, P, 0),),
        (BatchEntry("a", 2, P, 8), BatchEntry("b", 6, P, 0)),
        (BatchEntry("a", 1, D, 10), BatchEntry("b", 1, D, 6)),
        (BatchEntry("b", 1, D, 7),)]
    assert [(r.num_requests, r.num_prefill_tokens, r.num_decode_tokens)
            for r in engine.step_records] == [(1, 8, 0), (2, 8, 0), (2, 0, 2), (1, 0, 1)]
    assert [s.record for s in steps] == engine.step_records
    assert [[(o.request_id, o.index) for o in s] for s in steps] == [
        [], [("a", 0), ("b", 0)], [("a", 1), ("b", 1)], [("b", 2)]]
    assert [s.finished for s in steps] == [(), (), ("a",), ("b",)]
    assert all(s.failed == () and s.kv_reserved == () for s in steps)
    tokens = {rid: [o.token_id for s in steps for o in s if o.request_id == rid] for rid in "ab"}
    assert tokens == {"a": reference_generate(tiny.model, prompts[0], 2),
                      "b": reference_generate(tiny.model, prompts[1], 3)}
    # a steps.csv row keeps the batch: written by pandas, read back, the same entries
    rows = [{"worker": "colocated-0", **r.to_row()} for r in engine.step_records]
    assert rows[1]["batch"] == '[["a",2,"prefill",8],["b",6,"prefill",0]]'
    buf = io.StringIO()
    pd.DataFrame(rows).to_csv(buf, index=False)
    back = pd.read_csv(io.StringIO(buf.getvalue()))
    assert [parse_batch(text) for text in back["batch"]] == [r.batch for r in engine.step_records]
    assert list(back["num_prefill_tokens"]) == [8, 8, 0, 0]
    assert StepRecord(0.0, 1.0, 0, 0, 0).to_row()["batch"] == "[]"  # a hand-built record


def test_one_step_reports_its_reservation_failure_and_finish(tiny):
    prompts = random_prompts([5, 4], seed=32)
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=64,
                                       max_num_batched_tokens=32), quiet=True)
    execute = engine.runner.execute

    def poisoned(batch, hook=None):  # "bad"'s row cannot be sampled
        logits = execute(batch, hook).clone()  # an inference tensor cannot be edited
        rows = [s.request_id for i, s in enumerate(batch.requests) if batch.completes(i)]
        if "bad" in rows:
            logits[rows.index("bad")] = float("nan")
        return logits

    engine.runner.execute = poisoned
    engine.add_remote(Request("r", (5, 6, 7), SamplingParams(max_tokens=3)), 9)
    engine.add_request(Request("good", tuple(prompts[0]), SamplingParams(max_tokens=1)))
    engine.add_request(Request("bad", tuple(prompts[1]),
                               SamplingParams(max_tokens=3, temperature=0.7, seed=1)))
    step = engine.step()
    assert step.kv_reserved == ("r",)  # reserved, not computed: not in the batch
    assert step.record.batch == (BatchEntry("good", 5, P, 0), BatchEntry("bad", 4, P, 0))
    assert [(o.request_id, o.index, o.finish_reason) for o in step] == [
        ("good", 0, FinishReason.LENGTH)]
    assert step.tokens[0].token_id == reference_generate(tiny.model, prompts[0], 1)[0]
    assert step.finished == ("good",)
    assert [f.request_id for f in step.failed] == ["bad"]
    assert "sampling failed" in step.failed[0].error
    assert "bad" not in engine.states and "good" not in engine.states
    # a forward that fails: every request in it fails with the error; the reservation the
    # same step made is still reported, and nothing is recorded
    engine.finish_remote("r", torch.zeros(tiny.kv_spec.kv_shape(3), dtype=tiny.kv_spec.torch_dtype))
    engine.add_remote(Request("r2", (5, 6), SamplingParams(max_tokens=3)), 9)

    def broken(batch, hook=None):
        raise RuntimeError("boom")

    engine.runner.execute = broken
    step = engine.step()
    assert step.failed == (FailedRequest("r", "RuntimeError: boom"),)
    assert step.kv_reserved == ("r2",) and step.record is None and list(step) == []
    assert len(engine.step_records) == 1
    # a step whose only work is the reservation reports it, runs no forward
    engine.abort("r2")
    engine.add_remote(Request("r3", (5, 6), SamplingParams(max_tokens=3)), 9)
    step = engine.step()
    assert step.kv_reserved == ("r3",) and step.record is None and step.finished == ()
    assert len(engine.step_records) == 1
    engine.abort("r3")
    assert engine.is_empty()


def test_the_layer_listener_hears_every_layer_inside_the_forward(tiny):
    heard = []

    def listener(layer, batch):  # during the forward: counters not yet advanced
        heard.append((layer, [(s.request_id, s.num_computed_tokens) for s in batch.requests]))

    engine = Engine(tiny, EngineConfig(max_num_seqs=2, max_model_len=64,
                                       max_num_batched_tokens=32), quiet=True,
                    on_layer_done=listener)
    engine.add_request(Request("p", (3, 4, 5, 6), SamplingParams(max_tokens=4)),
                       prefill_only=True)
    step = engine.step()
    assert heard == [(0, [("p", 0)]), (1, [("p", 0)])]  # tiny: 2 layers
    assert engine.states["p"].num_computed_tokens == 4
    assert step.finished == ()  # PREFILLED holds its KV: not finished
    engine.finish_prefilled("p")
    assert engine.is_empty()
