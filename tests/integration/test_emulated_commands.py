"""``pdlab kv-cost`` and ``pdlab bench`` on emulated devices, with the Llama-3.1-8B
H100 SXM vLLM profile shipped in tests/data (``engine/configs/llama-3.1-8b``: 32 layers x 8 KV
heads x head_dim 128 x 2 B = 131072 KV bytes per token). The refusals are rows of
tests/integration/test_cli_options.py (``KV_COST_EMULATION_ROWS``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pandas as pd
import pytest

from engine.emulated import Emulation
from engine.config import ModelConfig
from engine.model import load_geometry
from experiments import cli, transfer_cost
from experiments.commands import serve
from planner.latency import DeviceProfile
from server.app import ServerThread

ROOT = Path(__file__).resolve().parents[2]
PROFILE = str(ROOT / "tests" / "data" / "llama-3.1-8b_h100_sxm_vllm_profile.json")
MODEL = "engine/configs/llama-3.1-8b"
# the profile's prefill fit (its JSON): a + b*T + c*T^2 seconds for a T-token prompt whole
A, B, C = 0.0055832692866859684, 1.5138057843645008e-05, 1.2092184742701231e-09
BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # 131072


def test_kv_cost_on_an_emulated_h100_at_one_256th_of_the_kv(tmp_path, capsys):
    code = cli.main(["kv-cost", "--device", "emu:0", "--device-profile", PROFILE, "--model", MODEL,
                     "--dtype", "bfloat16", "--emu-kv-scale", "0.00390625", "--prompt-lens",
                     "16,128", "--transports", "inprocess", "--repeats", "1", "--out",
                     str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "device emu:0 (emulated: h100_sxm" in out and "KV scale 0.00390625" in out
    assert "= 512 bytes/token (--emu-kv-scale 0.00390625)" in out
    df = pd.read_csv(tmp_path / "kv_cost.csv")
    assert len(df) == 4 and df["emulated"].all() and (df["kv_scale"] == 1 / 256).all()
    for t, rows in df.groupby("prompt_len"):
        # prefill: the profile's own fit, not a timing (16: 5.8258 ms, 128: 7.5408 ms)
        assert list(rows["prefill_s"]) == pytest.approx([A + B * t + C * t * t] * 2, rel=1e-9)
        # the KV moved: 32 layers x 1 head x round(8*128/256) = 4 x 2 B = 512 B per token
        assert (rows["kv_bytes"] == 512 * t).all()
        assert (rows["true_kv_bytes"] == BYTES_PER_TOKEN * t).all()
        # the profile's transfer model (nvlink: 10 us + bytes / 450 GB/s) at the true bytes
        assert list(rows["modelled_transfer_s"]) == pytest.approx(
            [1e-5 + BYTES_PER_TOKEN * t / 450e9] * 2, rel=1e-9)
    assert set(zip(df["mode"], df["num_chunks"])) == {("layer", 32), ("whole", 1)}
    assert list(df["transfer_over_prefill"]) == pytest.approx(
        list(df["transfer_s"] / df["prefill_s"]))
    assert (tmp_path / "kv_cost.png").stat().st_size > 0


def test_kv_cost_table_on_an_emulated_device_at_full_scale():
    emulation = Emulation(DeviceProfile.load(PROFILE))
    loaded = load_geometry(ModelConfig(MODEL, "bfloat16"))
    df = transfer_cost.kv_cost_table(loaded, [16], ("inprocess",), 1, emulation=emulation)
    assert list(df["kv_bytes"]) == list(df["true_kv_bytes"]) == [16 * BYTES_PER_TOKEN] * 2
    assert df["prefill_s"].iloc[0] == pytest.approx(A + 16 * B + 256 * C, rel=1e-9)
    with pytest.raises(ValueError, match="emulated device's KV lives on cpu"):
        transfer_cost.kv_cost_table(loaded, [16], ("inprocess",), 1, device="cuda:0",
                                    emulation=emulation)


def test_bench_against_serve_on_emulated_devices_says_emulated(tmp_path):
    """``pdlab bench`` drives ``pdlab serve --devices emu:0-1`` (disagg:1p1d, in-process) with
    token-id prompts (the emulated model has no tokenizer); the server's /v1/models carries
    the emulation block, so bench's config row and report say emulated."""
    args = cli.build_parser().parse_args(
        ["serve", "--model", MODEL, "--devices", "emu:0-1", "--placement", "disagg:1p1d",
         "--local", "--device-profile", PROFILE, "--emu-kv-scale", "0.00390625",
         "--max-model-len", "512"])
    dep, app = serve.build(args, serve.check(args))
    try:
        thread = ServerThread(app.app).start()
        try:
            card = httpx.get(f"{thread.url}/v1/models", timeout=30).json()["data"][0]
            code = cli.main(["bench", "--base-url", thread.url, "--label", "pdlab@disagg:1p1d",
                             "--model", MODEL, "--dtype", "bfloat16", "--dataset", "synthetic",
                             "--prompt-len", "32-64", "--output-len", "2-6", "--num-requests",
                             "4", "--seeds", "1", "--rates", "20", "--max-model-len", "512",
                             "--out", str(tmp_path)])
        finally:
            thread.stop()
    finally:
        dep.close()
    assert code == 0
    assert card["emulated"] is True and card["emulation"]["system"] == "h100_sxm"
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    config = rows[0]
    assert config["emulated"] is True and config["emulation"]["kv_scale"] == 1 / 256
    assert config["emulation"]["device_profile"] == PROFILE
    assert (tmp_path / "report.md").read_text().startswith(
        "# pdlab placement comparison (emulated devices)")
    requests = [r for r in rows[1:] if r["type"] == "request"]
    assert len(requests) == 4 and all(not r.get("error") for r in requests)
    assert all(math.isfinite(r["timeline"]["finished"]) for r in requests)
