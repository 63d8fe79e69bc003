"""Tensor parallelism on CPU cores: where TP 2 over two cores pays against TP 1 on one.

What is compared, side by side in one run (rounds interleaved, ``measure_interleaved``):

1. **all-reduce**: gloo's all-reduce of one decode row set, ``[B, hidden]`` float32 (the
   tensor each row-parallel projection sums), between two processes pinned to two cores,
   at B = 1 and 16: the price TP adds twice per layer.
2. **decode step**: one ``Engine.step()`` decoding B rows (context 128) of a TP 2 instance
   (rank 0 on core 0, rank 1 a process on core 1) against a TP 1 engine on core 0, at B = 1
   and 16.
3. **prefill**: one step prefilling a 512-token prompt, TP 2 against TP 1.
4. **KV transfer TP 2 -> TP 2** over shared memory: the put and get of that prompt's KV
   between two TP 2 instances (both on cores 0 and 1), through the rank 0s (prefill rank 0
   gathers every head and puts every slice; decode rank 0 gets, joins and scatters them)
   against rank to rank (``kv_transfer.rank_kv``); the decode side's KV checked equal.

The model is SmolLM2-135M's shape with heads TP 2 divides (SmolLM2's own 9 heads do not):
a seeded random Llama, hidden 512, 8 heads of 64, 4 KV heads, intermediate 1536, 30
layers, vocabulary 49152 (``--quick``: 8 layers), saved once under ``$PDLAB_CACHE_DIR`` so
the other rank loads the same weights. Its tokens are meaningless; TP 2's tokens are
checked equal to TP 1's.

Output: the tables with ``ratio TP2/TP1`` (below 1: TP 2 pays) and ``ratio direct/rank 0``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import add_common_args, estimator_line, measure_interleaved, print_table
from engine.config import EngineConfig, ModelConfig
from engine.device import bind_device
from engine.engine import Engine
from engine.model import cache_dir, load_model
from engine.parallel import TensorParallelGroup, connect, start_instance
from engine.kv_heads import transfer_map
from engine.request import Request, SamplingParams
from kv_transfer.payload import RankPart
from kv_transfer.rank_kv import get_on_ranks, put_on_ranks
from kv_transfer.shm import SharedMemoryTransport

CONTEXT = 128
PROMPT = 512


def _model_dir(num_layers: int) -> str:
    """The benchmark model (module docstring), built and saved once."""
    path = cache_dir() / "models" / f"bench-llama-h512-tp2-l{num_layers}"
    if not (path / "config.json").exists():
        config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536,
                             num_hidden_layers=num_layers, num_attention_heads=8,
                             num_key_value_heads=4, max_position_embeddings=2048,
                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                             architectures=["LlamaForCausalLM"])
        with torch.random.fork_rng():
            torch.manual_seed(0)
            LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


def _all_reduce_peer(init_method: str, shapes: list[tuple[int, int]], rounds: int) -> None:
    """Rank 1 of the all-reduce measurement (a spawn target): pinned to the last core, it
    joins every all-reduce rank 0 times."""
    bind_device(f"cpu:{sorted(os.sched_getaffinity(0))[-1]}")
    group = connect(init_method, 1, 2)
    for shape in shapes:
        tensor = torch.ones(shape)
        for _ in range(rounds):
            group.all_reduce(tensor)


def all_reduce_rows(batch_sizes: list[int], hidden: int, repeats: int) -> list[list[object]]:
    """Gloo all-reduce of ``[B, hidden]`` float32 between two pinned processes."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    init_method = f"store://127.0.0.1:{store.port}"
    shapes, inner = [(b, hidden) for b in batch_sizes], 200
    peer = torch.multiprocessing.get_context("spawn").Process(
        target=_all_reduce_peer, args=(init_method, shapes, (repeats + 1) * inner), daemon=True)
    peer.start()
    group = TensorParallelGroup(store, 0, 2)
    rows = []
    for shape in shapes:
        tensor = torch.ones(shape)

        def run() -> None:
            for _ in range(inner):
                group.all_reduce(tensor)

        t = measure_interleaved({"all-reduce": run}, repeats)["all-reduce"]
        rows.append([f"B={shape[0]} ({shape[0] * hidden * 4} bytes)", t.min_s / inner * 1e6,
                     t.median_s / inner * 1e6])
    peer.join(60)
    return rows


def _decode_ready(engine: Engine, batch_size: int, max_tokens: int, tag: str) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    for i in range(batch_size):
        prompt = torch.randint(3, 49152, (CONTEXT - 1,), generator=gen).tolist()
        engine.add_request(Request(f"{tag}{i}", tuple(prompt),
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    while any(s.is_prefilling for s in engine.states.values()) or engine.scheduler.waiting:
        engine.step()


def kv_transfer_rows(prefill: Engine, decode: Engine, prompt: tuple[int, ...],
                     repeats: int) -> list[list[object]]:
    """Put + get seconds of ``prompt``'s KV between two TP 2 engines over shm, via the rank
    0s and rank to rank (module docstring), and whether the decode side's KV equals it."""
    prefill.add_request(Request("kv", prompt, SamplingParams(max_tokens=64, ignore_eos=True)))
    prefill.step()  # the whole prompt in one step: its KV stays in these blocks
    blocks, num_tokens = prefill.prompt_kv_blocks("kv")
    targets = list(range(len(blocks)))  # decode blocks no request holds
    spec = prefill.kv_spec
    slices = transfer_map(spec.num_kv_heads, 2, 2)
    sender, receiver = SharedMemoryTransport(), SharedMemoryTransport()

    def via_rank0() -> None:  # what the workers do where the transport has no rank_factory
        kv = prefill.kv_store.read(blocks, num_tokens)  # gathered from both ranks
        handles = [sender.put("kv", spec, kv[:, :, s.heads.start:s.heads.stop].contiguous(),
                              part=RankPart(s.heads.start, s.prefill_rank, s.decode_rank, 2, 2))
                   for s in slices]
        parts = [receiver.get(h, spec, 30.0) for h in handles]
        whole = kv.new_empty(kv.shape)
        for header, part in parts:
            whole[:, :, header.head_start:header.head_start + part.shape[2]] = part
        decode.kv_store.write(targets, whole)  # scattered to both ranks
        del parts
        for h in handles:
            receiver.free(h)

    def direct() -> None:
        handles = put_on_ranks(prefill.kv_store, sender, sender.rank_factory(), "kv", spec,
                               blocks, num_tokens, slice(None), 0, 0, slices, (2, 2), None)
        get_on_ranks(decode.kv_store, receiver, receiver.rank_factory(), "kv", spec,
                     tuple(handles), targets, 0, 0, num_tokens, 2, "decode", 30.0)

    want = prefill.kv_store.read(blocks, num_tokens)
    equal = {}
    for name, run in (("rank 0", via_rank0), ("direct", direct)):
        decode.kv_store.write(targets, torch.zeros_like(want))
        run()
        equal[name] = torch.equal(decode.kv_store.read(targets, num_tokens), want)
    t = measure_interleaved({"rank 0": via_rank0, "direct": direct}, repeats)
    prefill.abort("kv")
    return [[f"{num_tokens} tokens ({want.numel() * want.element_size()} bytes)",
             t["rank 0"].min_s, t["direct"].min_s, t["direct"].min_s / t["rank 0"].min_s,
             "yes" if all(equal.values()) else "NO"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 20)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("tensor_parallel: needs 2 cores")
    bind_device(f"cpu:{cores[0]}")  # rank 0 and TP 1 on the first core, rank 1 on the last
    num_layers = 8 if args.quick else 30
    model_config = ModelConfig(_model_dir(num_layers))
    loaded = load_model(model_config)
    print(f"model: random Llama, hidden 512, 8 heads / 4 KV heads, {num_layers} layers, fp32; "
          f"TP 1 on core {cores[0]}, TP 2 on cores {cores[0]} and {cores[-1]}")
    print(estimator_line(repeats))

    print("\ngloo all-reduce of a decode row set [B, 512] float32, 2 processes (microseconds)")
    print_table(["rows", "min_us", "median_us"], all_reduce_rows([1, 16], 512, repeats))

    batch_sizes = [1, 16]
    config = EngineConfig(max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=2048,
                          enable_prefix_caching=False, kv_cache_memory_gb=0.5)
    single = Engine(loaded, config, quiet=True)
    instance = start_instance(loaded, model_config, config, 2,
                              devices=(f"cpu:{cores[0]}", f"cpu:{cores[-1]}"), quiet=True)
    try:
        tp2 = instance.engine
        rows = []
        for b in batch_sizes:
            max_tokens = repeats + 4
            _decode_ready(single, b, max_tokens, "a")
            _decode_ready(tp2, b, max_tokens, "b")
            t = measure_interleaved({"tp1": single.step, "tp2": tp2.step}, repeats)
            same = all(single.states[f"a{i}"].token_ids == tp2.states[f"b{i}"].token_ids
                       for i in range(b))
            rows.append([f"decode B={b}", t["tp1"].min_s, t["tp2"].min_s,
                         t["tp2"].min_s / t["tp1"].min_s, "yes" if same else "NO"])
            for i in range(b):
                single.abort(f"a{i}")
                tp2.abort(f"b{i}")
        prompt = tuple(torch.randint(3, 49152, (PROMPT,),
                                     generator=torch.Generator().manual_seed(7)).tolist())

        def prefill(engine: Engine):
            def run() -> None:
                engine.add_request(Request("p", prompt, SamplingParams(max_tokens=2)))
                engine.step()
                engine.abort("p")
            return run

        t = measure_interleaved({"tp1": prefill(single), "tp2": prefill(tp2)}, repeats)
        rows.append([f"prefill {PROMPT} tokens", t["tp1"].min_s, t["tp2"].min_s,
                     t["tp2"].min_s / t["tp1"].min_s, "-"])
        receiver = start_instance(loaded, model_config, config, 2,
                                  devices=(f"cpu:{cores[0]}", f"cpu:{cores[-1]}"), quiet=True)
        try:
            kv_rows = kv_transfer_rows(tp2, receiver.engine, prompt, repeats)
        finally:
            receiver.close()
    finally:
        instance.close()
    print("\nEngine.step() seconds (min), TP 2 on 2 cores vs TP 1 on 1 core")
    print_table(["step", "tp1_s", "tp2_s", "ratio TP2/TP1", "tokens equal"], rows)
    print("\nKV put + get seconds (min), TP 2 -> TP 2 over shm, 4 ranks on 2 cores")
    print_table(["prompt KV", "rank0_s", "direct_s", "ratio direct/rank 0", "KV equal"],
                kv_rows)


if __name__ == "__main__":
    main()
