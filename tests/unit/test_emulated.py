"""The emulated device (engine/emulated.py): a constant-time profile on a fake clock gives
the simulator's steps exactly; tokens are a function of the request; lateness is measured
and warned about; bad input is refused."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import sys
import threading
import time

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig, parse_devices
from engine import clock
from engine.clock import SPIN_S, TIMER_SLACK_NS, freeze_heap, precise_timers
from engine.emulated import Emulation, RealClock, emulated_token, lateness_warning, prompt_hash
from engine.engine import Engine
from engine.model import ModelLoadError, load_geometry
from engine.request import Request, RequestState, SamplingParams
from engine.scheduler import ScheduledBatch, StepFeatures
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from engine.serving import EngineLoop
from kv_transfer.inprocess import InProcessTransport
from planner.latency import DeviceProfile, Fit
from deployment.placement import Deployment
from planner.simulate import Simulator
from engine.events import DIED
from placement_helpers import collect_events, events_within, listen, watch_sends

LLAMA = "engine/configs/llama-3.1-8b"
LLAMA_BYTES = 2 * 32 * 8 * 128 * 2  # 2 (K, V) x layers x KV heads x head dim x bf16 bytes
STEP_S = 2.0 ** -6  # a power of two: every sum of steps is exact in floating point
BOUND_S = 30.0  # longest any wait here may take before the test fails (s)
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64)


def constant_profile(step_s: float = STEP_S, kv_bytes: int = LLAMA_BYTES) -> DeviceProfile:
    """Every step takes ``step_s``: intercepts only (the mixed fit adds the slopes, 0 here)."""
    fit = Fit(("1", "a", "b"), (step_s, 0.0, 0.0), 1.0, 0.0, 0.0, 1)
    mixed = Fit(("1", "slopes"), (step_s, 1.0), 1.0, 0.0, 0.0, 1)
    return DeviceProfile(LLAMA, "bfloat16", "cpu", "constant", 0, kv_bytes, fit, fit, mixed)


class FakeClock:
    """Time moves only when a step holds; ``lag`` is added to every hold (a busy host)."""

    def __init__(self, lag: float = 0.0) -> None:
        self.t, self.lag = 0.0, lag

    def time(self) -> float:
        return self.t

    def perf(self) -> float:
        return self.t

    def wait_until(self, deadline: float, idle=None) -> None:
        self.t = max(self.t, deadline) + self.lag


def requests() -> list[Request]:
    # 3 prompts of 40, 70 and 20 tokens (70 > the 64-token budget: chunked), 5/3/9 out
    return [Request(f"r{i}", tuple(range(10 + i, 10 + i + n)), SamplingParams(max_tokens=k))
            for i, (n, k) in enumerate([(40, 5), (70, 3), (20, 9)])]


def emulated_engine(clock: FakeClock, kv_scale: float = 1 / 256) -> Engine:
    loaded = load_geometry(ModelConfig(LLAMA, "bfloat16"))
    return Engine(loaded, ENGINE, quiet=True,
                  emulation=Emulation(constant_profile(), kv_scale, clock))


def test_geometry_of_llama_and_scaled_kv():
    loaded = load_geometry(ModelConfig(LLAMA, "bfloat16"))
    spec = loaded.kv_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, loaded.vocab_size) == (32, 8, 128, 128256)
    assert spec.bytes_per_token == LLAMA_BYTES == 131072 and loaded.eos_token_ids == (128001,)
    engine = emulated_engine(FakeClock())
    # 8 x 128 = 1024 elements per layer and K/V, / 256 -> 4: one head of 4
    assert (engine.kv_spec.num_kv_heads, engine.kv_spec.head_dim) == (1, 4)
    assert engine.kv_spec.bytes_per_token == LLAMA_BYTES // 256
    # blocks of the true geometry: 4 GiB CPU budget / (16 x 131072) = 2048, capped by
    # max_num_seqs x max_model_len / 16 = 4 x 16 = 64
    assert engine.kv_store.num_blocks == 64
    # a prompt's blocks are zeroed at their first use, as the real runner's: a put reads
    # defined bytes, and start-up does not grow with the budget
    store = engine.kv_store
    assert store.high_water == 0
    store.kv.fill_(1.0)  # (what an unzeroed page could hold)
    prompt = requests()[1]  # 70 tokens: 5 blocks, two chunks
    engine.generate([prompt])
    assert store.high_water == 5 and not store.kv[:, :, :, :5].any()
    assert store.kv[:, :, :, 5:].eq(1.0).all()


def test_constant_profile_on_fake_clock_equals_the_simulator_exactly():
    clock = FakeClock()
    engine = emulated_engine(clock)
    outputs = engine.generate(requests())
    real = [r.to_row() for r in engine.step_records]
    assert {row.pop("lateness") for row in real} == {1.0}
    sim = Simulator("colocated:1", ENGINE, constant_profile().step_time(),
                    kv_bytes_per_token=LLAMA_BYTES,
                    kv_budget_bytes=constant_profile().kv_budget_bytes(ENGINE)).run(
        [(r, 0.0) for r in requests()], collect_steps=True)
    simulated = [{k: v for k, v in row.items() if k != "worker"} for row in sim.steps]
    assert real == simulated
    assert [len(outputs[f"r{i}"]) for i in range(3)] == [5, 3, 9]  # max_tokens, never EOS
    # steps back to back from 0, each exactly STEP_S
    assert [row["start_s"] for row in real] == [i * STEP_S for i in range(len(real))]
    assert {row["duration_s"] for row in real} == {STEP_S}
    assert clock.t == len(real) * STEP_S


def test_tokens_are_a_function_of_prompt_and_position():
    a = emulated_engine(FakeClock()).generate(requests())
    b = emulated_engine(FakeClock(lag=1e-3)).generate(requests()[::-1])  # other order, late
    assert a == b
    r = requests()[2]
    digest = prompt_hash(r.prompt_token_ids)
    assert a["r2"] == [emulated_token(digest, i, 128256, {128001}) for i in range(9)]
    # a token never lands on EOS or a stop id: it steps forward past them
    token = emulated_token(digest, 0, 128256)
    assert emulated_token(digest, 0, 128256, {token, token + 1}) == token + 2
    assert emulated_token(7, 3, 2, {0}) == 1


def test_stop_ids_and_max_tokens_are_honoured():
    prompt = tuple(range(5, 25))
    free = emulated_engine(FakeClock()).generate(
        [Request("s", prompt, SamplingParams(max_tokens=6))])["s"]
    stop = Request("s", prompt, SamplingParams(max_tokens=6, stop_token_ids=(free[2],)))
    got = emulated_engine(FakeClock()).generate([stop])["s"]
    # the stop id is never produced (stepped past), so the request still runs to max_tokens
    assert len(free) == len(got) == 6 and got[2] == free[2] + 1
    assert got[:2] + got[3:] == free[:2] + free[3:]


def test_lateness_is_measured_and_warned():
    engine = emulated_engine(FakeClock(lag=STEP_S / 8))  # every hold 1/8 late
    engine.generate(requests())
    rows = [r.to_row() for r in engine.step_records]
    assert {row["lateness"] for row in rows} == {1.125}
    warning = lateness_warning(rows, "box-7")
    assert "1.125" in warning and "box-7" in warning
    on_time = [r.to_row() for r in emulated_engine(FakeClock()).step_records]
    assert lateness_warning(on_time, "box-7") is None
    assert lateness_warning([{"lateness": 1.02}] * 100, "h") is None  # the bound itself is fine
    assert lateness_warning([{"lateness": 1.0}] * 98 + [{"lateness": 1.5}] * 2, "h") is not None


def test_a_step_is_a_deadline_and_the_hosts_work_runs_inside_it():
    clock = FakeClock()
    engine = emulated_engine(clock)
    for request in requests():
        engine.add_request(request)
    launched = []
    started = engine.start_step(on_launch=lambda: launched.append(clock.t))
    # launched and returned at once: tokens stamped at the modelled end, no record yet
    assert launched == [0.0] and clock.t == 0.0
    assert started.record is None and engine.step_records == []
    assert [(o.request_id, o.index, o.time_s) for o in started] == [("r0", 0, STEP_S)]
    clock.t = STEP_S / 2  # the host's work for the step, inside its hold: free
    done = engine.finish_step(started)
    assert clock.t == STEP_S and done.tokens == started.tokens
    assert done.record == engine.step_records[0]
    assert (done.record.start_s, done.record.duration_s, done.record.lateness) == (0.0, STEP_S, 1.0)
    started = engine.start_step()
    clock.t += 1.5 * STEP_S  # past the step's end: late by half a step
    done = engine.finish_step(started)
    assert (done.record.start_s, done.record.duration_s, done.record.lateness) == (
        STEP_S, STEP_S, 1.5)
    assert engine.finish_step(done) is done  # nothing in flight


def test_a_step_left_early_is_still_held_and_the_next_one_begins_at_its_end():
    """``finish_step(lead_s)`` returns that long before the end; a step started meanwhile begins
    at that end (a launch queued behind the device's step); a host back after the end is late."""
    clock = FakeClock()
    engine = emulated_engine(clock)
    for request in requests():
        engine.add_request(request)
    done = engine.finish_step(engine.start_step(), lead_s=STEP_S / 4)
    assert clock.t == STEP_S * 3 / 4 and engine.device_busy
    assert (done.record.start_s, done.record.lateness) == (0.0, 1.0)
    started = engine.start_step()  # prepared inside the first step's hold
    assert [o.time_s for o in started] == [2 * STEP_S] * len(started)
    engine.wait_step_end()
    assert clock.t == STEP_S and not engine.device_busy
    engine.wait_step_end()  # none left: at once
    assert clock.t == STEP_S
    done = engine.finish_step(started, lead_s=STEP_S)  # at most half a step early
    assert clock.t == 1.5 * STEP_S and done.record.start_s == STEP_S
    engine.wait_step_end()
    started = engine.start_step()  # the device was idle: it begins now
    clock.t = 3.25 * STEP_S  # the host came back past the end: that step ran late
    done = engine.finish_step(started, lead_s=STEP_S / 4)
    assert not engine.device_busy
    assert (done.record.start_s, done.record.lateness) == (2 * STEP_S, 1.25)


class TickingClock(FakeClock):
    """Host work takes time too: every reading of ``perf`` moves the clock ``tick`` on."""

    def __init__(self, tick: float) -> None:
        super().__init__()
        self.tick = tick

    def perf(self) -> float:
        self.t += self.tick
        return self.t


def test_a_loop_prepares_the_next_step_inside_the_hold_so_steps_run_back_to_back():
    """With host work taking time, each step of a busy loop begins exactly where the one before
    ended (its host work ran inside that hold), and no token leaves before its step's end."""
    clock = TickingClock(2.0 ** -22)
    loop = EngineLoop("colocated-0", ModelConfig(LLAMA, "bfloat16"), ENGINE, device="emu:0",
                      bind=False, emulation=Emulation(constant_profile(), 1 / 256, clock))
    got: list = []
    early: list = []  # (clock, stamp) of a token sent before its stamp
    try:
        watch_sends(loop, lambda events: early.extend(
            (clock.t, e.time_s) for e in events if e.time_s > clock.t))
        # all at once, on the loop's thread: its engine never runs dry before the last ends
        loop.call(lambda: [loop.engine.add_request(r) for r in requests()])
        end_s = time.monotonic() + BOUND_S
        while len(got) < 5 + 3 + 9:
            assert time.monotonic() < end_s, f"the loop stalled: {got}"
            got += events_within(loop, 0.5)
        records = loop.call(lambda: list(loop.engine.step_records))
    finally:
        loop.shutdown()
    assert len(records) >= 9
    assert all(b.start_s == a.start_s + STEP_S for a, b in zip(records, records[1:]))
    assert all(r.lateness == 1.0 for r in records)
    ends = {r.start_s + STEP_S for r in records}
    assert all(e.time_s in ends for e in got) and early == []


@pytest.mark.parametrize("how", ["check_ranks", "launch_step"])
def test_a_loop_dying_while_a_step_ends_still_sends_that_step_s_tokens(how):
    """The loop left the first step's hold early, then dies before that step's end (a dead
    rank at the next turn, or the next launch raising): the step's tokens (r1 finished in it)
    still leave, before the last words."""
    loop = EngineLoop("colocated-0", ModelConfig(LLAMA, "bfloat16"), ENGINE, device="emu:0",
                      bind=False, emulation=Emulation(constant_profile(), 1 / 256))
    try:
        finish_step, launch_step, stepped = (loop.engine.finish_step, loop.engine.launch_step,
                                             threading.Event())

        def one_step(*args, **kwargs):
            output = finish_step(*args, **kwargs)
            stepped.set()
            return output

        def check_ranks():
            if how == "check_ranks" and stepped.is_set():
                raise RuntimeError("rank 1 died")

        def launch(*args, **kwargs):
            if how == "launch_step" and stepped.is_set():
                raise RuntimeError("schedule failed")
            return launch_step(*args, **kwargs)
        loop.engine.finish_step, loop._check_ranks, loop.engine.launch_step = (
            one_step, check_ranks, launch)
        listen(loop)
        loop.call(lambda: [loop.engine.add_request(r) for r in (  # both in the first step
            Request("r0", (3, 4, 5), SamplingParams(max_tokens=5)),
            Request("r1", (6, 7, 8), SamplingParams(max_tokens=1)))])
        loop._thread.join(timeout=BOUND_S)
        assert not loop._thread.is_alive()
        events = collect_events(loop, lambda events: events and events[-1].kind == DIED)
        assert sorted((e.kind, e.request_id, e.index) for e in events[:-1]) == [
            ("token", "r0", 0), ("token", "r1", 0)], events
    finally:
        loop.shutdown()


def test_real_clock_hands_a_hold_to_idle_work_then_spins_to_the_deadline():
    clock, naps = RealClock(), []

    def idle(left_s: float) -> None:
        naps.append(left_s)
        time.sleep(left_s / 2)

    deadline = clock.perf() + 0.5
    clock.wait_until(deadline, idle)
    assert clock.perf() >= deadline
    assert naps and all(0 < s <= 0.5 - SPIN_S for s in naps)


class HoldProbe(FakeClock):
    """Notes every event a loop lets out while a hold runs that is stamped after its start."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: EngineLoop | None = None
        self.early: list = []

    def wait_until(self, deadline: float, idle=None) -> None:
        if self.loop is not None:
            self.early += [e for e in list(self.loop._events) if e.time_s > self.t]
        super().wait_until(deadline)


def test_a_loop_lets_no_token_out_before_its_step_ends():
    clock = HoldProbe()
    loop = EngineLoop("colocated-0", ModelConfig(LLAMA, "bfloat16"), ENGINE, device="emu:0",
                      bind=False, emulation=Emulation(constant_profile(), 1 / 256, clock))
    clock.loop = loop
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    stamps = []
    try:
        for request in requests():
            loop.submit(request)
        end_s = time.monotonic() + 60.0
        while sum(map(len, outputs.values())) < 5 + 3 + 9:
            assert time.monotonic() < end_s, f"the loop stalled: {outputs}"
            for event in events_within(loop, 0.5):
                outputs[event.request_id].append(event.token_id)
                stamps.append(event.time_s)
    finally:
        loop.shutdown()
    assert clock.early == []
    assert outputs == emulated_engine(FakeClock()).generate(requests())
    assert all(s % STEP_S == 0 and s > 0 for s in stamps)  # each at a step's end


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="emu_kv_scale must be in"):
        Emulation(constant_profile(), 0.0)
    with pytest.raises(ValueError, match="emu_kv_scale must be in"):
        Emulation(constant_profile(), 2.0)
    with pytest.raises(ModelLoadError, match="not a directory with a config.json"):
        load_geometry(ModelConfig("engine/configs/no-such-model", "bfloat16"))
    with pytest.raises(ValueError, match="has 512 KV bytes per token, model .* 131072: "
                                         "the profile is not this model's"):
        emulated_engine_with(constant_profile(kv_bytes=512))


def emulated_engine_with(profile: DeviceProfile) -> Engine:
    return Engine(load_geometry(ModelConfig(LLAMA, "bfloat16")), ENGINE, quiet=True,
                  emulation=Emulation(profile, 1 / 256, FakeClock()))


# ---- through the real placements (workers in this process, in-process transport) ---------
PROFILE = "tests/data/llama-3.1-8b_h100_sxm_vllm_profile.json"  # pdlab profile --from-silicon-db
FAST = EngineConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256,
                    device_profile=PROFILE, emu_kv_scale=1 / 256)


def deploy(placement: str, devices: str = "emu:0-1", engine: EngineConfig = FAST,
           granularity: str = "request"):
    return Deployment(PlacementConfig(placement, devices), ModelConfig(LLAMA), engine,
                      TransferConfig(transport="inprocess", timeout_s=10.0,
                                     granularity=granularity, layers_per_chunk=8), local=True)


def workload():
    return [(Request(f"w{i}", tuple(range(100 + i, 100 + i + n)), SamplingParams(max_tokens=k)),
             0.002 * i) for i, (n, k) in enumerate([(30, 6), (90, 4), (12, 9), (60, 5)])]


def test_tokens_identical_across_placements_and_reruns():
    outputs = {}
    runs = [("colocated:2", "request"), ("disagg:1p1d", "request"), ("colocated:2", "request"),
            ("disagg:1p1d", "layer")]  # layer: the hold runs in execute, layer by layer
    for run, (placement, granularity) in enumerate(runs):
        with deploy(placement, granularity=granularity) as deployment:
            records = deployment.run(workload())
            steps = deployment.step_records()
            infos = deployment.gather("info")
            transfers = deployment.transfer_records()
        outputs[run] = {r.request_id: r.output_token_ids for r in records}
        assert all(r.error is None for r in records)
        assert [len(outputs[run][f"w{i}"]) for i in range(4)] == [6, 4, 9, 5]
        assert all(s["lateness"] >= 1.0 for s in steps)  # a hold never ends early
        assert {i["kernels"]["backend"] for i in infos} == {"emulated"}
        assert {i["kv_spec"]["head_dim"] for i in infos} == {4}  # 8 x 128 / 256
        if placement.startswith("disagg"):  # the scaled KV went through the transport
            assert {r.kv_bytes for r in records} == {
                2 * 32 * 4 * 2 * r.num_prompt_tokens for r in records}
            assert len(transfers) == 4 * (1 if granularity == "request" else 32 // 8)
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]


@pytest.mark.parametrize("devices,engine,words", [
    ("emu:0-1", EngineConfig(), "emulated devices (emu:0,emu:1) need a device profile"),
    ("cpu:0", FAST, "only emulated devices"),
    ("emu:0-1", EngineConfig(device_profile="tests/data/tiny_device_profile.json"),
     "has no model engine/configs/llama-3.1-8b: it profiles tiny-random-llama"),
    ("emu:0-1", EngineConfig(device_profile="/nonexistent.json"), "cannot read device profile"),
])
def test_deployment_refuses_bad_emulation(devices, engine, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        deploy("colocated:1", devices, engine)


def test_parse_emulated_devices():
    assert parse_devices("emu:0-3") == ("emu:0", "emu:1", "emu:2", "emu:3")
    assert parse_devices("emu:0,emu:5") == ("emu:0", "emu:5")
    with pytest.raises(ValueError, match="low-high"):
        parse_devices("emu:3-1")
    with pytest.raises(ValueError, match="must not mix"):
        parse_devices("emu:0,cpu:1")
    with pytest.raises(ValueError, match="must not repeat"):
        parse_devices("emu:0-1,emu:1")


def test_step_features_hand_computed():
    fresh = RequestState(Request("a", tuple(range(3, 43)), SamplingParams(max_tokens=4)))
    chunk = RequestState(Request("b", tuple(range(3, 43)), SamplingParams(max_tokens=4)))
    chunk.num_computed_tokens = 24
    decode = RequestState(Request("c", tuple(range(3, 13)), SamplingParams(max_tokens=9)))
    decode.token_ids += [5, 6, 7]  # 10 prompt + 3 outputs, 12 computed: the 13th decodes
    decode.num_computed_tokens = 12
    batch = ScheduledBatch()
    for state, n in ((decode, 1), (fresh, 24), (chunk, 16)):
        batch.add(state, n)
    # prefill: 24 + 16 tokens, pairs 24 * (0 + 24) + 16 * (24 + 16); decode: B = 1, ctx 12 + 1
    assert batch.step_features() == StepFeatures(40, 576 + 640, 1, 13)


def test_silicon_profile_on_fake_clock_keeps_the_simulators_times():
    """The H100 profile (not constant): every step starts when the simulator's does and
    lasts its modelled time (to rounding: the engine records end - start)."""
    profile = DeviceProfile.load(PROFILE)
    clock = FakeClock()
    engine = Engine(load_geometry(ModelConfig(LLAMA, "bfloat16")), ENGINE, quiet=True,
                    emulation=Emulation(profile, 1 / 256, clock))
    engine.generate(requests())
    real = [r.to_row() for r in engine.step_records]
    sim = Simulator("colocated:1", ENGINE, profile.step_time(), kv_bytes_per_token=LLAMA_BYTES,
                    kv_budget_bytes=profile.kv_budget_bytes(ENGINE)).run(
        [(r, 0.0) for r in requests()], collect_steps=True).steps
    assert [(r["start_s"], r["batch"]) for r in real] == [(s["start_s"], s["batch"]) for s in sim]
    assert [r["duration_s"] for r in real] == pytest.approx([s["duration_s"] for s in sim],
                                                            rel=1e-12)
    assert sim[0]["duration_s"] > 0.0055  # an H100 prefill step: ~6 ms, not the constant


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(2) is Linux's")
def test_precise_timers_sets_the_calling_threads_timer_slack_to_1_us():
    prctl = ctypes.CDLL(None).prctl
    seen = {}

    def fresh_thread() -> None:  # (the test's own thread keeps its slack)
        seen["set"] = precise_timers()
        seen["after"] = prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK: this thread's, in ns

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    assert seen == {"set": True, "after": TIMER_SLACK_NS} and TIMER_SLACK_NS == 1000


def test_freeze_heap_freezes_what_lives_at_its_first_call_only(monkeypatch):
    # Judged by what a full pass scans, never by gc.get_freeze_count(): another thread of
    # the test process may free frozen objects at any time, so the count can only go down.
    monkeypatch.setattr(clock, "_heap_frozen", False)
    kept = [[i] for i in range(1000)]  # (a dict of atoms only would be untracked)
    assert all(gc.is_tracked(k) for k in kept)
    try:
        freeze_heap()
        scanned = {id(o) for o in gc.get_objects()}  # what a full pass scans
        assert not any(id(k) in scanned for k in kept)
        later = [[i] for i in range(1000)]
        freeze_heap()  # a second call: nothing more is frozen
        scanned = {id(o) for o in gc.get_objects()}
        assert all(id(k) in scanned for k in later)
        assert not any(id(k) in scanned for k in kept)
    finally:
        gc.unfreeze()


class _AfterStepProbe(EngineLoop):
    """Notes, per step, the clock when ``on_step`` ran and when its ``after_step`` work ran."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.seen = clock, []
        super().__init__("colocated-0", ModelConfig(LLAMA, "bfloat16"), ENGINE, device="emu:0",
                         bind=False, emulation=Emulation(constant_profile(), 1 / 256, clock))

    def on_step(self, output) -> None:
        if output.record is None and output.tokens:  # a step in flight (its hold not run out)
            at = self.clock.t
            self.after_step(lambda: self.seen.append((at, self.clock.t)))


def test_after_step_work_waits_for_the_emulated_step_to_end():
    """What ``after_step`` defers (a decode worker's KV fetch) runs when the step's hold has run
    out, one step's time after the step began, as on a device whose loop is back only after
    the forward; with no step in flight it runs at once."""
    loop = _AfterStepProbe(FakeClock())
    try:
        for request in requests():
            loop.submit(request)
        end_s = time.monotonic() + 60.0
        while len(loop.seen) < 5 or loop.call(loop.engine.has_unfinished):
            assert time.monotonic() < end_s, f"the loop stalled: {loop.seen}"
            time.sleep(0.01)
        ran: list[str] = []  # (all requests done: no step in flight)
        loop.call(lambda: loop.after_step(lambda: ran.append("now")))
        assert ran == ["now"]
    finally:
        loop.shutdown()
    assert all(end == pytest.approx(start + STEP_S) for start, end in loop.seen)


class _CountingTransport(InProcessTransport):
    def __init__(self) -> None:
        super().__init__()
        self.gets: list = []
        self.frees: list = []

    def get(self, handle, *args, **kwargs):
        self.gets.append(handle.key)
        return super().get(handle, *args, **kwargs)

    def free(self, handle) -> None:
        self.frees.append(handle.key)
        super().free(handle)


class _HookClock(FakeClock):
    """A fake clock that calls ``hook()`` (on the loop thread) whenever a step's hold runs."""

    def __init__(self) -> None:
        super().__init__()
        self.hook = lambda: None

    def wait_until(self, deadline: float, idle=None) -> None:
        self.hook()
        super().wait_until(deadline)


def test_an_abort_while_the_reserving_step_runs_frees_the_kv_once_and_fetches_nothing():
    """A decode worker's fetch waits for the step that reserved its slot to end; an abort
    during that step frees the handles there and then, and no fetch starts after it."""
    clock, transport = _HookClock(), _CountingTransport()
    worker = DecodeWorker("decode-0", ModelConfig(LLAMA, "bfloat16"), ENGINE, TransferConfig(),
                          device="emu:0", transport=transport, bind=False,
                          emulation=Emulation(constant_profile(), 1 / 256, clock))
    seen: list = []
    admitted = threading.Event()

    def abort_once_reserved() -> None:
        admitted.wait(BOUND_S)
        state = worker.engine.states.get("r0")
        # once reserved and its step's news ran (a step prepared ahead reserves before that)
        if not seen and state is not None and state.block_ids is not None and worker._after_step:
            seen.append((len(worker._after_step), worker._transfers["r0"].fetching))
            worker._abort("r0")
    clock.hook = abort_once_reserved
    try:
        spec = worker.engine.kv_spec
        worker.submit(Request("c0", tuple(range(10, 30)), SamplingParams(max_tokens=50)))
        handle = transport.put("r0", spec, torch.zeros(spec.kv_shape(20), dtype=spec.torch_dtype))
        worker.admit(Request("r0", tuple(range(40, 60)), SamplingParams(max_tokens=4)), 7,
                     (handle,))
        admitted.set()
        end_s = time.monotonic() + BOUND_S
        while not seen or worker.call(worker.engine.has_unfinished):
            assert time.monotonic() < end_s and worker._died is None, (seen, worker._died)
            time.sleep(0.005)
        assert seen == [(1, False)]  # deferred to the step's end, not started
        assert transport.gets == [] and transport.frees == [handle.key]
        assert worker.call(lambda: dict(worker._transfers)) == {} and transport.num_held() == 0
    finally:
        worker.shutdown()


class _ClockedTransport(InProcessTransport):
    """Notes the clock at each put and whether the worker's port had sent the request's first
    token by then."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock, self.worker, self.puts = clock, None, []

    def put(self, request_id, *args, **kwargs):
        sent = any(e.request_id == request_id for e in self.worker.sent_tokens)
        self.puts.append((request_id, self.clock.t, sent))
        return super().put(request_id, *args, **kwargs)


def emulated_prefill_worker(clock: FakeClock, transport: InProcessTransport) -> PrefillWorker:
    worker = PrefillWorker("prefill-0", ModelConfig(LLAMA, "bfloat16"), ENGINE, TransferConfig(),
                           device="emu:0", transport=transport, bind=False,
                           emulation=Emulation(constant_profile(), 1 / 256, clock))
    worker.sent_tokens = []
    watch_sends(worker, lambda events: worker.sent_tokens.extend(
        e for e in events if e.kind == "token"))
    return worker


def test_an_emulated_prefill_worker_puts_after_its_step_while_the_next_one_runs():
    """Host work takes time (a ticking clock): the second prompt's step still begins exactly at
    the first one's end (launched inside its hold), and each put comes after its step's end,
    its first token already sent."""
    clock = TickingClock(2.0 ** -22)
    transport = _ClockedTransport(clock)
    worker = emulated_prefill_worker(clock, transport)
    transport.worker = worker
    prompts = [Request(f"r{i}", tuple(range(10 + i, 10 + i + 60)), SamplingParams(max_tokens=4))
               for i in range(2)]  # 60 tokens each: one prompt per 64-token step
    try:
        worker.call(lambda: [worker._add(r, prefill_only=True) for r in prompts])
        events = collect_events(worker, lambda got: sum(e.kind == "prefilled" for e in got) == 2,
                                timeout_s=BOUND_S)
        records = worker.call(lambda: list(worker.engine.step_records))
    finally:
        worker.shutdown()
    assert [e.kind for e in events].count("token") == 2
    first, second = records[:2]
    assert second.start_s == first.start_s + STEP_S  # back to back: the put did not hold it
    assert [(rid, sent) for rid, _, sent in transport.puts] == [("r0", True), ("r1", True)]
    ends = [first.start_s + STEP_S, second.start_s + STEP_S]
    assert all(end <= t < end + STEP_S for (_, t, _), end in zip(transport.puts, ends))


def test_an_emulated_prefill_worker_aborted_during_its_step_puts_nothing_and_reports_nothing():
    """An abort applied while the step that prefills the request runs: at the step's end
    neither its first token nor a put nor an error follows, and it holds no KV."""
    clock = _HookClock()
    transport = _ClockedTransport(clock)
    worker = emulated_prefill_worker(clock, transport)
    transport.worker = worker

    def abort_in_the_hold() -> None:
        if "r0" in worker.engine.states:
            worker._abort("r0")
    clock.hook = abort_in_the_hold
    try:
        worker.call(lambda: worker._add(Request("r0", tuple(range(10, 50)),
                                                SamplingParams(max_tokens=4)), prefill_only=True))
        end_s = time.monotonic() + BOUND_S
        while worker.call(worker.engine.has_unfinished):
            assert time.monotonic() < end_s and worker._died is None, worker._died
            time.sleep(0.005)
        clock.hook = lambda: None
        worker.call(lambda: worker._add(Request("r1", tuple(range(10, 30)),
                                                SamplingParams(max_tokens=1)), prefill_only=True))
        events = collect_events(worker, lambda got: any(e.request_id == "r1" for e in got),
                                timeout_s=BOUND_S)
        status = worker.status()
    finally:
        worker.shutdown()
    assert [(e.kind, e.request_id) for e in events] == [("token", "r1")]
    assert transport.puts == [] and status["transport_held"] == 0 and status["engine_empty"]


def test_an_emulated_prefill_worker_never_idles_while_a_prompt_waits_for_a_seat():
    """One seat (``max_num_seqs=1``): the step launched ahead finds it still held by the
    prompt whose put is pending and comes out empty; once that put has run at the step's end,
    the waiting prompt is launched at once, never behind an idle wait for a command."""
    engine = dataclasses.replace(ENGINE, max_num_seqs=1)
    worker = PrefillWorker("prefill-0", ModelConfig(LLAMA, "bfloat16"), engine,
                           TransferConfig(), device="emu:0", transport=InProcessTransport(),
                           bind=False, emulation=Emulation(constant_profile(), 1 / 256,
                                                           FakeClock()))
    listen(worker)
    idled = []  # blocking waits for a command while a prompt waited (a fake clock never
    drain = worker._drain_commands  # hands a hold to ``idle``, so no other wait blocks)

    def noting_drain(block, timeout_s=0.1):
        if block and worker.engine.scheduler.waiting:
            idled.append(timeout_s)
        drain(block, timeout_s)
    worker._drain_commands = noting_drain
    prompts = [Request(f"r{i}", tuple(range(10 + i, 10 + i + 60)), SamplingParams(max_tokens=4))
               for i in range(2)]
    try:
        worker.call(lambda: [worker._add(r, prefill_only=True) for r in prompts])
        events = collect_events(worker, lambda got: sum(e.kind == "prefilled" for e in got) == 2,
                                timeout_s=BOUND_S)
        status = worker.status()
    finally:
        worker.shutdown()
    assert idled == [] and [e.request_id for e in events if e.kind == "prefilled"] == ["r0", "r1"]
    assert status["engine_empty"] and status["transport_held"] == 2
