"""The vLLM side of the benchmarks, run by ``.venv-vllm/bin/python`` (never imported by pdlab).

A JSON-lines loop, so a benchmark can alternate pdlab and vLLM runs in one process pair:

1. Start: ``python benchmarks/vllm_worker.py MODEL_DIR MAX_MODEL_LEN BUDGET [CACHING
   [BLOCK_SIZE [NUM_BLOCKS]]]`` builds one offline ``vllm.LLM`` (fp32, prefix caching only if
   CACHING is ``1``, BLOCK_SIZE-token blocks, NUM_BLOCKS blocks via
   ``num_gpu_blocks_override`` (one is vLLM's null block), chunked prefill at BUDGET, prompts
   as token ids), then prints ``{"ready": true, "version": ...}``.
2. ``{"prompts": [[ids]], "max_tokens": n}`` runs one greedy ``LLM.generate`` (EOS ignored)
   and prints ``{"seconds", "outputs", "num_cached_tokens", "minor_faults", "system_s"}``:
   the call's wall time, outputs, each request's prefix-cache hit, and the process's minor
   page faults and system CPU seconds during the call. ``"reset_prefix_cache": true`` empties
   the cache first (untimed).
3. ``{"admission": true, "prompts", "max_tokens": [n per prompt]}`` adds every prompt at once
   and steps the engine by hand; prints ``{"peak_running", "num_preemptions", "kv_blocks",
   "steps", "seconds"}`` (most requests running after any step, preemptions summed, usable
   KV blocks before the first request).
4. ``{"step_times": true, "prompts", "max_tokens": n}`` times each ``step()``; prints
   ``{"steps": [[seconds, tokens, first tokens, finished requests], ...]}``.
5. An empty line or EOF ends it.

vLLM's own logs go to stderr; stdout carries only these JSON lines."""

from __future__ import annotations

import itertools
import json
import resource
import sys
import time

_step_ids = itertools.count()  # request ids stay unique across a worker's jobs


def main() -> int:
    model_dir, max_model_len, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    caching = len(sys.argv) > 4 and sys.argv[4] == "1"
    block = {"block_size": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    if len(sys.argv) > 6:
        block["num_gpu_blocks_override"] = int(sys.argv[6])
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # anything vLLM prints stays off the protocol channel
    # imported after the redirect: what vLLM prints on import must not reach the channel
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", max_model_len=max_model_len,
              max_num_batched_tokens=budget, enable_chunked_prefill=True,
              enable_prefix_caching=caching, skip_tokenizer_init=True, max_num_seqs=256, seed=0,
              **block)

    def reply(obj: dict) -> None:
        real_stdout.write(json.dumps(obj) + "\n")
        real_stdout.flush()

    reply({"ready": True, "version": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        if job.get("admission"):
            reply(admission(llm, job["prompts"], job["max_tokens"]))
            continue
        if job.get("step_times"):
            reply(step_times(llm, job["prompts"], job["max_tokens"]))
            continue
        if job.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                                detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        reply({"seconds": seconds, "outputs": [list(r.outputs[0].token_ids) for r in results],
               "num_cached_tokens": [r.num_cached_tokens or 0 for r in results],
               "minor_faults": after.ru_minflt - before.ru_minflt,
               "system_s": after.ru_stime - before.ru_stime})
    return 0


def _request_types():
    """vLLM's ``SamplingParams``, ``TokensPrompt`` and ``RequestOutputKind``, imported on first
    use: vLLM exists only in .venv-vllm, where main() runs this module (after it moved
    stdout aside)."""
    from vllm import SamplingParams  # local: vLLM exists only in .venv-vllm
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    return SamplingParams, TokensPrompt, RequestOutputKind


def admission(llm, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    """Every prompt added at once, greedy, EOS ignored; the engine stepped by hand so the
    scheduler (in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) can be read after
    each step."""
    SamplingParams, TokensPrompt, _ = _request_types()
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    kv_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"adm{i}", TokensPrompt(prompt_token_ids=p),
                           SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True,
                                          detokenize=False))
    peak, steps, preempted = 0, 0, {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, len(scheduler.running))
        for rid, req in scheduler.requests.items():
            preempted[rid] = req.num_preemptions
    return {"peak_running": peak, "num_preemptions": sum(preempted.values()),
            "kv_blocks": kv_blocks, "steps": steps, "seconds": time.perf_counter() - start}


def step_times(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt added at once (greedy, EOS ignored), vLLM's engine stepped by hand with
    each step timed; outputs as deltas, so a step reports every token it made. Returns
    ``{"steps": [[seconds, tokens, first tokens, finished requests], ...]}``, one row per
    step (``benchmarks.vs_vllm.decode_step_s`` reads them)."""
    SamplingParams, TokensPrompt, RequestOutputKind = _request_types()
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False, output_kind=RequestOutputKind.DELTA)
    made: dict[str, int] = {}  # request id -> tokens it has made
    for p in prompts:
        request_id = f"st{next(_step_ids)}"
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=p), params)
        made[request_id] = 0
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - start
        tokens = first = finished = 0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            first += made[out.request_id] == 0 and n > 0
            made[out.request_id] += n
            tokens += n
            finished += out.finished
        steps.append([seconds, tokens, first, finished])
    return {"steps": steps}


if __name__ == "__main__":
    sys.exit(main())
