"""``pdlab profile``'s KV cost over gloo (``time_torchdist``): two spawned ranks that form
their group through the held rendezvous (``open_rendezvous``; that a rendezvous port cannot
be taken and that ranks move KV through it, values equal, is
``test_transports.py::test_torchdist_gloo_two_processes_through_the_held_rendezvous``)."""

from engine.kv_cache import KVSpec

SPEC = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=8,
              dtype="float32")


def test_kv_cost_torchdist_measures_through_the_held_rendezvous():
    from experiments.transfer_cost import time_torchdist

    timings = time_torchdist(SPEC, [(4, [(0, 2)]), (4, [(0, 1), (1, 2)])], repeats=2,
                             timeout_s=120.0)
    assert [t.num_runs for t in timings] == [2, 2]
    assert all(t.min_s > 0 for t in timings)
