"""Wire format: round trips, byte counts, layer ranges, header validation, checksums."""

import dataclasses

import msgpack
import pytest
import torch

from engine.kv_cache import KVSpec
from kv_transfer.payload import (WIRE_VERSION, KVChecksumError, KVSpecMismatch, RankPart, pack,
                                 unpack)

SPEC = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=8,
              dtype="float32")


def random_kv(spec: KVSpec, num_tokens: int, num_layers: int | None = None) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(spec.kv_shape(num_tokens, num_layers)).to(spec.torch_dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_preserves_values_and_dtype(dtype):
    spec = dataclasses.replace(SPEC, dtype=dtype)
    kv = random_kv(spec, 5)
    frames = pack("r1", spec, kv)
    header, out = unpack(frames, spec)
    assert out.dtype == spec.torch_dtype and out.shape == (2, 2, 2, 5, 8)
    assert torch.equal(out, kv)
    # nothing upcast: bytes on the wire are exactly the formula, 2 * L * H_kv * D * T * itemsize
    assert len(frames[1]) == spec.kv_bytes(5) == 2 * 2 * 2 * 8 * 5 * spec.itemsize
    assert (header.request_id, header.token_start, header.token_end) == ("r1", 0, 5)
    assert header.wire_version == WIRE_VERSION and header.shape == (2, 2, 2, 5, 8)


def test_bfloat16_bytes_are_half_of_float32():
    bf16 = dataclasses.replace(SPEC, dtype="bfloat16")
    assert len(pack("r", bf16, random_kv(bf16, 7))[1]) * 2 == len(pack("r", SPEC, random_kv(SPEC, 7))[1])


def test_non_contiguous_input_round_trips():
    base = torch.randn(2, 2, 8, 6, 2)  # [L, 2, D, T, H] -> permuted to [L, 2, H, T, D]
    kv = base.permute(0, 1, 4, 3, 2)
    assert not kv.is_contiguous()
    header, out = unpack(pack("r1", SPEC, kv), SPEC)
    assert torch.equal(out, kv) and out.is_contiguous()


def test_layer_range_payload():
    kv = random_kv(SPEC, 4, num_layers=1)  # only layer 1
    frames = pack("r1", SPEC, kv, token_start=3, layer_start=1)
    header, out = unpack(frames, SPEC)
    assert (header.layer_start, header.layer_end) == (1, 2)
    assert (header.token_start, header.token_end) == (3, 7)
    assert len(frames[1]) == SPEC.kv_bytes(4, num_layers=1)
    assert torch.equal(out, kv)


def test_layer_range_beyond_receiver_layers_is_rejected():
    kv = random_kv(SPEC, 4, num_layers=2)
    with pytest.raises(KVSpecMismatch, match="layer range"):
        unpack(pack("r1", SPEC, kv, layer_start=1), SPEC)


def test_a_head_slice_names_its_heads_and_ranks_and_carries_only_them():
    kv = random_kv(SPEC, 5)[:, :, 1:2]  # KV head 1 of 2
    part = RankPart(head_start=1, prefill_rank=1, decode_rank=0, prefill_tp=2, decode_tp=1)
    frames = pack("r1", SPEC, kv, part=part)
    header, out = unpack(frames, SPEC)
    assert header.part == part and header.num_kv_heads == 2 and header.shape == (2, 2, 1, 5, 8)
    assert len(frames[1]) == SPEC.kv_bytes(5) // 2 and torch.equal(out, kv)
    with pytest.raises(ValueError, match="must be torch.float32 of shape"):
        pack("r1", SPEC, kv, part=RankPart(head_start=2))  # heads [2, 3) of 2
    header = msgpack.unpackb(bytes(frames[0]))
    header["head_start"] = 2
    with pytest.raises(KVSpecMismatch, match=r"KV heads expected within \[0, 2\), got \[2, 3\)"):
        unpack([msgpack.packb(header), frames[1]], SPEC)


def test_received_tensor_is_writable_and_independent_of_read_only_frames():
    kv = random_kv(SPEC, 3)
    header_bytes, tensor_bytes = pack("r1", SPEC, kv)
    frames = [header_bytes, bytes(tensor_bytes)]
    _, out = unpack(frames, SPEC)
    out.zero_()  # must not fail, and must not touch the frame
    _, again = unpack(frames, SPEC)
    assert torch.equal(again, kv)


def test_writable_frame_is_not_copied():
    kv = random_kv(SPEC, 3)
    header_bytes, tensor_bytes = pack("r1", SPEC, kv)
    buffer = bytearray(tensor_bytes)
    _, out = unpack([header_bytes, buffer], SPEC)
    out.fill_(0)
    assert not any(buffer)


@pytest.mark.parametrize("field, value", [
    ("dtype", "bfloat16"),
    ("num_kv_heads", 4),
    ("head_dim", 16),
    ("model_fingerprint", "other-model:def"),
    ("num_layers", 3),
])
def test_header_mismatch_names_field_expected_and_got(field, value):
    sender = dataclasses.replace(SPEC, **{field: value})
    frames = pack("r1", sender, random_kv(sender, 4))
    with pytest.raises(KVSpecMismatch) as info:
        unpack(frames, SPEC)
    expected = getattr(SPEC, field)
    assert str(info.value) == (
        f"KV header mismatch for request r1: {field} expected {expected}, got {value}")
    assert (info.value.field, info.value.expected, info.value.got) == (field, expected, value)
    assert isinstance(info.value, ValueError)


def test_wire_version_mismatch():
    header_bytes, tensor_bytes = pack("r1", SPEC, random_kv(SPEC, 2))
    header = msgpack.unpackb(header_bytes)
    header["wire_version"] = WIRE_VERSION + 1
    with pytest.raises(KVSpecMismatch, match=f"wire_version expected {WIRE_VERSION}, got {WIRE_VERSION + 1}"):
        unpack([msgpack.packb(header), tensor_bytes], SPEC)


def test_truncated_bytes_are_a_byte_count_mismatch():
    header_bytes, tensor_bytes = pack("r1", SPEC, random_kv(SPEC, 2))
    with pytest.raises(KVSpecMismatch, match=f"num_bytes expected {SPEC.kv_bytes(2)}, got {SPEC.kv_bytes(2) - 4}"):
        unpack([header_bytes, bytes(tensor_bytes)[:-4]], SPEC)


def test_checksum_catches_a_flipped_byte():
    header_bytes, tensor_bytes = pack("r1", SPEC, random_kv(SPEC, 4))
    corrupted = bytearray(tensor_bytes)
    corrupted[17] ^= 0x01
    with pytest.raises(KVChecksumError, match="r1"):
        unpack([header_bytes, corrupted], SPEC)


def test_without_checksum_corruption_goes_unnoticed():
    kv = random_kv(SPEC, 4)
    header_bytes, tensor_bytes = pack("r1", SPEC, kv, checksum=False)
    corrupted = bytearray(tensor_bytes)
    corrupted[17] ^= 0x01
    header, out = unpack([header_bytes, corrupted], SPEC)
    assert header.checksum is None and not torch.equal(out, kv)


def test_pack_rejects_a_tensor_not_matching_the_spec():
    with pytest.raises(ValueError, match="must be torch.float32"):
        pack("r1", SPEC, torch.zeros(2, 2, 3, 4, 8))  # 3 KV heads, spec has 2
    with pytest.raises(ValueError, match="must be torch.float32"):
        pack("r1", SPEC, torch.zeros(SPEC.kv_shape(4), dtype=torch.float16))
