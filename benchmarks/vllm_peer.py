"""vLLM's CPU build as a benchmark peer: a subprocess in its own virtualenv (``make vllm-venv``).

``VLLMPeer`` starts ``benchmarks/vllm_worker.py`` with ``.venv-vllm/bin/python`` pinned to
the benchmark's own cores (the same ``taskset`` cores and thread count as pdlab), and sends
it one job per call, so a benchmark alternates pdlab and vLLM round by round. vLLM runs
offline (``vllm.LLM``), fp32, prefix caching **off** (``enable_prefix_caching`` turns it on),
one engine process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no second process competing for the pinned core),
with its default compilation. The model is the SmolLM2 directory pdlab caches
(``engine.model.cache_dir()/models/smollm2-135m``), so both load the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from engine.model import SMOLLM2_NAME, cache_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
# The vLLM virtualenv: ``$PDLAB_VLLM_VENV`` where set (e.g. one made by another checkout),
# else this checkout's ``.venv-vllm``.
VENV_PYTHON = Path(os.environ.get("PDLAB_VLLM_VENV", REPO_ROOT / ".venv-vllm")) / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
START_TIMEOUT_S = 900.0


def available() -> bool:
    """True if the vLLM virtualenv exists (``make vllm-venv`` creates ``.venv-vllm``)."""
    return VENV_PYTHON.exists()


class VLLMPeer:
    """One vLLM ``LLM`` in a subprocess. ``run(prompts, max_tokens) -> (seconds, outputs)``:
    ``seconds`` is vLLM's ``generate`` wall time, measured inside the subprocess (no IPC);
    ``outputs`` the greedy token ids per prompt (EOS ignored). ``num_kv_blocks`` (with
    ``block_size``) fixes vLLM's KV cache at that many blocks (``num_gpu_blocks_override``;
    one is vLLM's null block, so ``num_kv_blocks - 1`` are usable) instead of
    ``kv_cache_gib``.

    Raises:
        RuntimeError: the virtualenv is missing, or the worker died / answered no JSON
            (its stderr tail is in the message).
    """

    def __init__(self, max_model_len: int, max_num_batched_tokens: int,
                 cores: list[int] | None = None, kv_cache_gib: int = 2,
                 enable_prefix_caching: bool = False, block_size: int | None = None,
                 num_kv_blocks: int | None = None) -> None:
        if not available():
            raise RuntimeError(f"{VENV_PYTHON} not found: run `make vllm-venv` first")
        cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_AOT_COMPILE="0",
                   VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
                   OMP_NUM_THREADS=str(len(cores)), VLLM_LOGGING_LEVEL="WARNING",
                   TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)  # pdlab's torch/transformers must not shadow vLLM's
        self.stderr_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdlab-vllm-{os.getpid()}.log"
        self._stderr = open(self.stderr_path, "w")
        model_dir = cache_dir() / "models" / SMOLLM2_NAME
        self.proc = subprocess.Popen(
            ["taskset", "-c", ",".join(map(str, cores)), str(VENV_PYTHON), str(WORKER),
             str(model_dir), str(max_model_len), str(max_num_batched_tokens),
             "1" if enable_prefix_caching else "0"]
            + ([str(block_size)] if block_size else [])
            + ([str(num_kv_blocks)] if block_size and num_kv_blocks else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env=env, cwd=str(REPO_ROOT))
        self.version = self._read()["version"]

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        seconds, outputs, _ = self.run_cached(prompts, max_tokens)
        return seconds, outputs

    def run_cached(self, prompts: list[list[int]], max_tokens: int,
                   reset_prefix_cache: bool = False) -> tuple[float, list[list[int]], list[int]]:
        """``run``, plus each request's prefix-cache hit in tokens; ``reset_prefix_cache``
        empties vLLM's prefix cache first (untimed)."""
        reply = self._job({"prompts": prompts, "max_tokens": max_tokens,
                           "reset_prefix_cache": reset_prefix_cache})
        return reply["seconds"], reply["outputs"], reply["num_cached_tokens"]

    def run_rusage(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, float]:
        """``run``'s seconds, and vLLM's process's minor page faults and system CPU seconds
        during the ``generate`` call (``getrusage``)."""
        reply = self._job({"prompts": prompts, "max_tokens": max_tokens})
        return reply["seconds"], reply["minor_faults"], reply["system_s"]

    def admission(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        """All ``prompts`` at once (``max_tokens`` each, greedy, EOS ignored), vLLM's engine
        stepped by hand; returns ``{"peak_running", "num_preemptions", "kv_blocks", "steps",
        "seconds"}`` (``vllm_worker.admission``: peak = most requests in vLLM's scheduler
        ``running`` list after a step; kv_blocks = usable blocks, null block excluded)."""
        return self._job({"admission": True, "prompts": prompts, "max_tokens": max_tokens})

    def step_times(self, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        """All ``prompts`` at once (``max_tokens`` each, greedy, EOS ignored), each engine
        step timed inside vLLM's process: ``[[seconds, tokens, first tokens, finished
        requests], ...]`` per step (``vllm_worker.step_times``)."""
        return self._job({"step_times": True, "prompts": prompts,
                          "max_tokens": max_tokens})["steps"]

    def _job(self, job: dict) -> dict:
        """Send one job line to the worker and return its JSON reply (``vllm_worker``)."""
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._stderr.flush()
            tail = self.stderr_path.read_text()[-3000:]
            raise RuntimeError(f"vLLM worker exited (rc={self.proc.poll()}); stderr tail:\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def __enter__(self) -> VLLMPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
