"""kv_transfer.link: the link peaks every transfer record is scored against."""

import pytest
import torch

from kv_transfer.link import ProbeSource, memcpy_peak, pattern, probe_peak
from kv_transfer.nixl import nixl_available

NUM_BYTES = 1 << 20


def test_memcpy_peak_reports_bytes_and_method():
    peak = memcpy_peak(NUM_BYTES, repeats=2)
    assert peak.method == "memcpy" and peak.num_bytes == NUM_BYTES and peak.gbps > 0
    with pytest.raises(ValueError, match="repeats"):
        memcpy_peak(NUM_BYTES, repeats=0)


@pytest.mark.parametrize("use_nixl", [
    False, pytest.param(True, marks=pytest.mark.skipif(not nixl_available(),
                                                       reason="pip install 'pdlab[nixl]'"))])
def test_probe_moves_the_source_buffer_and_times_it(use_nixl):
    source = ProbeSource(NUM_BYTES, use_nixl=use_nixl)
    try:
        out = torch.zeros(NUM_BYTES, dtype=torch.uint8)
        peak = probe_peak(source.ticket, repeats=2, out=out)
    finally:
        source.close()
    assert peak.method == ("nixl" if use_nixl else "tcp") == source.ticket.method
    assert peak.num_bytes == NUM_BYTES and peak.gbps > 0
    assert torch.equal(out, pattern(NUM_BYTES))  # every byte of the source arrived
