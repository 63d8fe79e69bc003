"""The typed placement: spellings, canonical form, device binding and the model refusals."""

from __future__ import annotations

import pytest

from engine.config import PlacementConfig, parse_placement, placement_engine_overrides, EngineConfig
from engine.placement import Instance, Placement, check_tp


def sizes(p: Placement) -> list[tuple[str, int, int]]:
    return [(i.name, i.tp, i.pp) for i in p.instances]


@pytest.mark.parametrize("text", ["colocated:1", "colocated:3", "colocated-nochunk:2",
                                  "disagg:1p1d", "disagg:2p3d", "conditional:1p2d"])
def test_todays_spellings_mean_what_they_meant_and_read_back_unchanged(text):
    p = Placement.parse(text)
    assert str(p) == text
    assert not p.is_parallel and p.num_devices == sum(p.counts)
    assert all(i.tp == 1 and i.pp == 1 for i in p.instances)
    assert (p.kind, *p.counts) == parse_placement(text)


def test_per_phase_sizes():
    p = Placement.parse("disagg:1p1d+ptp2")
    assert sizes(p) == [("prefill-0", 2, 1), ("decode-0", 1, 1)]
    assert p.num_devices == 3 and p.size_of("prefill") == (2, 1) and p.size_of("decode") == (1, 1)
    p = Placement.parse("disagg:2p1d+ptp2+dtp4+dpp2")
    assert sizes(p) == [("prefill-0", 2, 1), ("prefill-1", 2, 1), ("decode-0", 4, 2)]
    assert p.num_devices == 2 * 2 + 8
    assert str(p) == "disagg:2p1d+ptp2+dtp4+dpp2"


def test_a_size_for_every_role_and_the_canonical_spelling():
    p = Placement.parse("Colocated:2+TP2")
    assert sizes(p) == [("colocated-0", 2, 1), ("colocated-1", 2, 1)]
    assert str(p) == "colocated:2+tp2" and p.num_devices == 4 and p.chunked
    both = Placement.parse("disagg:1p1d+ptp2+dtp2")
    assert str(both) == "disagg:1p1d+tp2" and both == Placement.parse("disagg:1p1d+tp2")
    assert str(Placement.parse("disagg:1p1d+ptp1+dtp2")) == "disagg:1p1d+dtp2"
    nochunk = Placement.parse("colocated-nochunk:1+tp2+pp2")
    assert not nochunk.chunked and str(nochunk) == "colocated-nochunk:1+tp2+pp2"
    assert nochunk.num_devices == 4
    for text in ("disagg:2p1d+ptp2+dtp4+dpp2", "conditional:1p1d+pp2", "colocated:3+tp4"):
        assert Placement.parse(str(Placement.parse(text))) == Placement.parse(text)


def test_kind_and_counts_ignore_sizes_and_the_typed_config_counts_devices():
    assert parse_placement("disagg:1p2d+ptp2") == ("disagg", 1, 2)
    assert parse_placement("disagg:1p2d+tp1") == ("disagg", 1, 2)
    assert PlacementConfig("disagg:1p1d+ptp2+dtp1").num_devices_needed == 3
    assert PlacementConfig("colocated:2+tp2").num_devices_needed == 4
    engine = EngineConfig(max_model_len=1024, max_num_batched_tokens=256)
    assert not placement_engine_overrides("colocated-nochunk:1+tp2", engine).enable_chunked_prefill
    assert placement_engine_overrides("colocated:1+tp2", engine) is engine


@pytest.mark.parametrize("text,words", [
    ("disagg:1p1d+tp0", ("TP size must be >= 1",)),
    ("disagg:1p1d+ptp2+ptp4", ("prefill TP size is given twice",)),
    ("disagg:1p1d+tp2+dtp4", ("decode TP size is given twice",)),
    ("colocated:2+ptp2", ("colocated placement has no phases", "'+tp2'")),
    ("disagg:1p1d+xtp2", ("bad size 'xtp2'", "+ptpT")),
    ("disagg:1p1d+", ("bad size ''",)),
    ("disagg:1p1d,ptp2", ("disagg:xPyD", "'disagg:1p1d,ptp2'")),
    ("disagg:0p1d+tp2", ("x, y >= 1",)),
    ("colocated:0+tp2", ("N >= 1",)),
])
def test_bad_sizes_are_refused_with_one_line(text, words):
    with pytest.raises(ValueError) as info:
        Placement.parse(text)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"


def test_bind_takes_devices_in_order_and_refuses_too_few():
    p = Placement.parse("disagg:1p2d+ptp2").bind(("cpu:0", "cpu:1", "cpu:2", "cpu:3", "cpu:4"))
    assert [(i.name, i.devices) for i in p.instances] == [
        ("prefill-0", ("cpu:0", "cpu:1")), ("decode-0", ("cpu:2",)), ("decode-1", ("cpu:3",))]
    assert p.of_role("decode")[1].device == "cpu:3"
    with pytest.raises(ValueError, match="needs 4 devices, the device set cpu:0,cpu:1,cpu:2 has 3"):
        Placement.parse("disagg:1p1d+tp2").bind(("cpu:0", "cpu:1", "cpu:2"))
    with pytest.raises(ValueError, match="bind the placement"):
        Instance("decode", 0).device


@pytest.mark.parametrize("tp,heads,kv_heads,ok", [
    (1, 4, 2, True), (2, 4, 2, True), (4, 4, 2, True),  # 4: each KV head on 2 ranks
    (3, 4, 2, False), (8, 4, 2, False),  # 8 does not divide 4 attention heads
    (3, 9, 3, True), (9, 9, 3, True), (2, 9, 3, False),  # SmolLM2: 9 heads, 3 KV heads
    (8, 64, 8, True), (16, 64, 8, True), (4, 32, 8, True), (6, 48, 8, False),
])
def test_check_tp_follows_vllms_rule(tp, heads, kv_heads, ok):
    if ok:
        check_tp(tp, heads, kv_heads)
    else:
        with pytest.raises(ValueError, match=f"TP {tp} does not suit"):
            check_tp(tp, heads, kv_heads)


def test_check_model_names_the_role_and_the_model():
    Placement.parse("disagg:1p1d+ptp2+dtp4").check_model(4, 2, 2, "tiny-random-llama")
    with pytest.raises(ValueError) as info:
        Placement.parse("disagg:1p1d+ptp2+dtp3").check_model(4, 2, 2, "tiny-random-llama")
    assert str(info.value) == (
        "decode TP 3 does not suit tiny-random-llama: TP must divide its 4 attention heads "
        "and divide or be a multiple of its 2 KV heads")
    with pytest.raises(ValueError, match="colocated PP 3 exceeds tiny-random-llama's 2 layers"):
        Placement.parse("colocated:1+pp3").check_model(4, 2, 2, "tiny-random-llama")


def test_the_simulator_refuses_instances_over_several_devices_without_their_step_model():
    from planner.simulate import InstanceModel, Simulator

    with pytest.raises(ValueError, match="needs the colocated instances' own step model"):
        Simulator("colocated:1+tp2", EngineConfig(), lambda *f: 0.01)
    with pytest.raises(ValueError, match="needs the decode instances' own step model"):
        Simulator("disagg:1p1d+dtp2", EngineConfig(), lambda *f: 0.01, transfer=None,
                  instance_models={"prefill": InstanceModel(lambda *f: 0.01, 0)})
