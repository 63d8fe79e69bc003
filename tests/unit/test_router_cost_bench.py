"""benchmarks.router_cost at a tiny size: the CSV's columns and that every count adds up
(its speed is the benchmark's business, not a test's)."""

from __future__ import annotations

import pandas as pd
import pytest

from benchmarks import router_cost


@pytest.mark.parametrize("channel, workers", [("unix", "1"), ("sockets", "1"), ("local", "2,1")])
def test_every_token_the_fakes_send_reaches_the_front_end(tmp_path, channel, workers):
    router_cost.main(["--workers", workers, "--running", "3", "--output-lens", "2,6",
                      "--prompt-len", "8", "--seconds", "0.4", "--warmup-s", "0.2",
                      "--channel", channel, "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "router_cost.csv")
    assert list(table.columns) == router_cost.COLUMNS
    assert list(table["workers"]) == [int(n) for n in workers.split(",")]
    assert set(table["channel"]) == {channel}
    # each request's max_tokens, drawn by the front end, is exactly what its worker sent
    assert (table["tokens_relayed"] == table["tokens_sent"]).all()
    assert (table["tokens_sent"] == table["tokens_requested"]).all()
    # the front end kept `running` requests per worker in flight, one new per finished one
    assert (table["requests_finished"] >= 3 * table["workers"]).all()
    assert (table["tokens_sent"] >= 2 * table["requests_finished"]).all()
    assert (table["tokens_sent"] <= 6 * table["requests_finished"]).all()
