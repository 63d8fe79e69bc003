"""The vLLM side of the benchmarks, run by ``.venv-vllm/bin/python`` (never imported by pdlab).

A JSON-lines loop so that a benchmark can alternate pdlab and vLLM runs in one process pair:

1. Start: ``python benchmarks/vllm_worker.py MODEL_DIR MAX_MODEL_LEN BUDGET [CACHING
   [BLOCK_SIZE [NUM_BLOCKS]]]``; builds one offline ``vllm.LLM`` (fp32, prefix caching off
   unless CACHING is ``1``, KV blocks of BLOCK_SIZE tokens if given (else vLLM's default),
   NUM_BLOCKS KV blocks if given (``num_gpu_blocks_override``; vLLM holds one back as its
   null block, so NUM_BLOCKS - 1 are usable), else what ``VLLM_CPU_KVCACHE_SPACE`` holds,
   chunked prefill at token budget BUDGET, no tokenizer: prompts are token ids), then
   prints ``{"ready": true, "version": ...}``.
2. Each stdin line ``{"prompts": [[ids]], "max_tokens": n}`` runs one ``LLM.generate`` over
   all prompts (greedy, EOS ignored) and prints ``{"seconds": s, "outputs": [[ids]],
   "num_cached_tokens": [n], "minor_faults": n, "system_s": s}``, where ``s`` is the wall
   time of that ``generate`` call (``time.perf_counter``), ``num_cached_tokens`` each
   request's prefix-cache hit (``RequestOutput.num_cached_tokens``), and the last two the
   process's minor page faults and system CPU time during the call (``getrusage``). ``"reset_prefix_cache": true`` in the job empties
   the prefix cache first (untimed).
3. A line ``{"admission": true, "prompts": [[ids]], "max_tokens": [n per prompt]}`` adds
   every prompt at once and steps ``llm.llm_engine`` by hand, reading the scheduler after
   each step; it prints ``{"peak_running": n, "num_preemptions": n, "kv_blocks": n,
   "steps": n, "seconds": s}``: the most requests in the scheduler's ``running`` list after
   any step (prefilling or decoding), preemptions summed over requests (each request's
   ``num_preemptions``, sampled every step), and the usable KV blocks (the block pool's
   free blocks before the first request).
4. A line ``{"step_times": true, "prompts": [[ids]], "max_tokens": n}`` adds every prompt
   at once and steps ``llm.llm_engine`` by hand, timing each ``step()`` (outputs as deltas);
   it prints ``{"steps": [[seconds, tokens, first tokens, finished requests], ...]}``.
5. An empty line or EOF ends it.

vLLM's own logs go to stderr; stdout carries only these JSON lines.
"""

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
