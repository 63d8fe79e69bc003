"""Tensor parallelism inside one instance: its ranks are processes, one per device, each
holding a slice of every layer and of the paged KV cache; one scheduler (rank 0's engine)
decides every step and its batch reaches every rank.

Layout (Megatron-LM, Shoeybi et al. 2019; nano-vllm's ``layers/linear.py``), at TP ``t``:

- Q/K/V and gate/up are column-parallel: rank ``r`` keeps the output rows of its query heads
  (``engine.kv_heads.query_heads_of``), its KV heads (``kv_heads_of``: replicated on ``t /
  H_kv`` ranks when ``t > H_kv``, as vLLM does) and its ``I / t`` intermediate features;
- O and down are row-parallel: rank ``r`` keeps the matching input columns, the partial
  outputs summed by one all-reduce after each (two per layer), their biases kept by rank 0;
- embeddings, norms, RoPE and the LM head are replicated: after each all-reduce every rank
  holds the same hidden state, so every rank computes the same logits (rank 0 samples).

Each rank runs the unchanged ``engine.runner.ModelRunner`` on its shard over its own
``KVStore`` of its local KV heads; the same block ids index every rank's store. Rank 0 owns
the ``Engine`` and broadcasts what the runner reads of each batch (``StepRows``) to the other
ranks, which run ``follow`` until ``TensorParallelGroup.stop``. Rank 0 reaches every rank's
KV store through ``InstanceKVStore`` (every head gathered or scattered, or ``each_rank``).

``TensorParallelGroup`` is a process group of the instance's ranks only, on a rendezvous
store, apart from ``torch.distributed``'s default group (the ``torchdist`` KV transport's):
gloo on CPU, NCCL on CUDA. Every collective has the group's deadline: a dead rank makes the
others' next collective fail (rank 0's engine fails that step's requests), never hang.
"""

from __future__ import annotations

import copy
import datetime
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from engine.config import cpu_cores_of
from engine.device import bind_device
from engine.engine import Engine
from engine.kv_cache import KVStore
from engine.kv_heads import kv_heads_of, query_heads_of
from engine.model import LoadedModel, load_model
from engine.placement import check_tp
from engine.runner import ModelRunner

BACKENDS = ("gloo", "nccl")


def backend_for(device: str) -> str:
    """The collective backend of a device: ``nccl`` for ``cuda:i``, else ``gloo``."""
    return "nccl" if device.startswith("cuda") else "gloo"


class TensorParallelGroup:
    """The ranks of one instance: ``size`` processes, this one ``rank`` in ``[0, size)``,
    over a ``torch.distributed.Store`` shared by every rank (``prefix`` keeps instances
    apart on one store); ``backend`` ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors);
    ``timeout_s`` the deadline of every collective, in seconds.

    Raises:
        ValueError: a rank outside ``[0, size)``, an unknown backend, or ``nccl`` in a torch
            built without it.
    """

    def __init__(self, store, rank: int, size: int, backend: str = "gloo",
                 timeout_s: float = 120.0, prefix: str = "tp") -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.rank, self.size, self.backend = rank, size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore(prefix, store)
        if backend == "nccl":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise ValueError("backend nccl: this torch was built without NCCL")
            options = nccl.Options()
            options._timeout = timeout
            self.pg = nccl(store, rank, size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)
            self.device = torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (every rank gets the same values)."""
        self.pg.allreduce([tensor]).wait()
        return tensor

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (pickled; a length, then the bytes)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length)
        if self.rank != 0:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(data)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.backend == "nccl":  # NCCL moves device tensors only
            moved = tensor.to(self.device)
            self.pg.broadcast(moved, 0).wait()
            tensor.copy_(moved.cpu())
        else:
            self.pg.broadcast(tensor, 0).wait()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape on all) on rank 0, in rank order; None on the
        other ranks."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.backend == "nccl":
            moved = tensor.to(self.device)
            outs = [[torch.empty_like(moved) for _ in range(self.size)]] if self.rank == 0 else []
            self.pg.gather(outs, [moved], opts).wait()
            return [o.cpu() for o in outs[0]] if self.rank == 0 else None
        outs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        self.pg.gather(outs, [tensor], opts).wait()
        return outs[0] if self.rank == 0 else None

    def gather_object(self, obj) -> list | None:
        """Every rank's picklable ``obj`` on rank 0, in rank order (None on the others): the
        longest pickle's length (all-reduce max), then the padded pickles (gather)."""
        data = pickle.dumps(obj)
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.pg.allreduce([length], opts).wait()
        longest = int(length.item())
        padded = torch.zeros(8 + longest, dtype=torch.uint8)
        padded[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        if data:
            padded[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = self.gather(padded)
        if parts is None:
            return None
        out = []
        for part in parts:
            raw = part.numpy().tobytes()
            out.append(pickle.loads(raw[8:8 + int.from_bytes(raw[:8], "little")]))
        return out

    def scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None = None) -> None:
        """Rank 0's ``inputs[r]`` into rank ``r``'s ``output`` (same shape and dtype on all;
        ``inputs`` only on rank 0)."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        if self.backend == "nccl":
            moved = output.to(self.device)
            sent = [[t.to(self.device) for t in inputs]] if self.rank == 0 else []
            self.pg.scatter([moved], sent, opts).wait()
            output.copy_(moved.cpu())
        else:
            self.pg.scatter([output], [inputs] if self.rank == 0 else [], opts).wait()

    def stop(self) -> None:
        """Rank 0: end every other rank's ``follow`` loop."""
        self.broadcast_object(None)

    def close(self) -> None:
        """Shut the group's backend down (its threads joined) before the process exits: a
        gloo group left to the interpreter's exit can abort the process (SIGABRT)."""
        try:
            self.pg.shutdown()
        except RuntimeError:  # a peer already gone: nothing left to shut cleanly
            pass


# ---- sharding ---------------------------------------------------------------------------

def _rows(weight: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    """The rows ``[a, b)`` of each part, concatenated (a new contiguous tensor)."""
    return torch.cat([weight[a:b] for a, b in parts]).contiguous()


def _set(module: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is None:
        module.register_parameter("bias", None)
    else:
        module.bias = torch.nn.Parameter(bias.contiguous(), requires_grad=False)
    module.out_features, module.in_features = weight.shape


def _column(module: torch.nn.Linear, parts: list[tuple[int, int]]) -> None:
    """Keep output rows ``parts`` (column-parallel)."""
    bias = None if module.bias is None else _rows(module.bias.detach(), parts)
    _set(module, _rows(module.weight.detach(), parts), bias)


def _row(module: torch.nn.Linear, a: int, b: int, keep_bias: bool) -> None:
    """Keep input columns ``[a, b)`` (row-parallel); the bias only where ``keep_bias``."""
    bias = module.bias.detach() if module.bias is not None and keep_bias else None
    _set(module, module.weight.detach()[:, a:b].contiguous(), bias)


def shard_model(model: torch.nn.Module, rank: int, tp: int) -> torch.nn.Module:
    """Rank ``rank``'s shard of a supported decoder model at TP ``tp``: a copy whose layers
    keep the rows/columns of the module docstring and whose config reads ``H_q / tp`` heads,
    its local KV heads, ``I / tp`` features and an explicit ``head_dim``.

    Raises:
        ValueError: ``tp`` does not suit the heads (``engine.placement.check_tp``) or does not
            divide the intermediate size.
    """
    cfg = model.config
    heads, kv_heads, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    check_tp(tp, heads, kv_heads, f"TP {tp}", getattr(cfg, "_name_or_path", None) or "the model")
    if inter % tp:
        raise ValueError(f"TP {tp} does not divide the model's intermediate size {inter}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    q_heads, my_kv = query_heads_of(rank, tp, heads), kv_heads_of(rank, tp, kv_heads)
    q_rows = (q_heads[0] * head_dim, (q_heads[-1] + 1) * head_dim)
    kv_rows = (my_kv[0] * head_dim, (my_kv[-1] + 1) * head_dim)
    i_rows = (rank * inter // tp, (rank + 1) * inter // tp)
    shard = copy.deepcopy(model)
    for layer in shard.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):  # Phi-3: q, k, v rows of one fused projection
            q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
            _column(attn.qkv_proj, [q_rows, (q_end + kv_rows[0], q_end + kv_rows[1]),
                                    (k_end + kv_rows[0], k_end + kv_rows[1])])
        else:
            _column(attn.q_proj, [q_rows])
            _column(attn.k_proj, [kv_rows])
            _column(attn.v_proj, [kv_rows])
        _row(attn.o_proj, *q_rows, keep_bias=rank == 0)
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate then up, one fused projection
            _column(mlp.gate_up_proj, [i_rows, (inter + i_rows[0], inter + i_rows[1])])
        else:
            _column(mlp.gate_proj, [i_rows])
            _column(mlp.up_proj, [i_rows])
        _row(mlp.down_proj, *i_rows, keep_bias=rank == 0)
    shard.config.num_attention_heads = len(q_heads)
    shard.config.num_key_value_heads = len(my_kv)
    shard.config.intermediate_size = inter // tp
    shard.config.head_dim = head_dim
    return shard


def shard_loaded(loaded: LoadedModel, rank: int, tp: int) -> LoadedModel:
    """``loaded`` with ``shard_model``'s model and a ``KVSpec`` of the rank's KV heads (same
    fingerprint: the ranks of one instance serve one model)."""
    return replace(loaded, model=shard_model(loaded.model, rank, tp),
                   kv_spec=replace(loaded.kv_spec,
                                   num_kv_heads=len(kv_heads_of(rank, tp, loaded.kv_spec.num_kv_heads))))


class _AllReduced:
    """A row-parallel projection: the local matmul, then the sum over the group's ranks."""

    def __init__(self, fused, group: TensorParallelGroup) -> None:
        self.fused, self.group = fused, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.fused(x).contiguous())


def parallel_runner(loaded_shard: LoadedModel, kv_store: KVStore, device: str,
                    group: TensorParallelGroup) -> ModelRunner:
    """A ``ModelRunner`` over a shard whose O and down projections all-reduce over
    ``group`` (the runner calls ``layer.o.fused`` and ``layer.down.fused``)."""
    runner = ModelRunner(loaded_shard.model, kv_store, device)
    if group.size > 1:
        _wrap_row_parallel(runner, group)
    return runner


def _wrap_row_parallel(runner: ModelRunner, group: TensorParallelGroup) -> None:
    for layer in runner.layers:  # prepared once per shard model: wrap once, rebind the group
        for linear in (layer.o, layer.down):
            if isinstance(linear.fused, _AllReduced):
                linear.fused.group = group
            else:
                linear.fused = _AllReduced(linear.fused, group)


# ---- the step's batch, as every rank reads it -------------------------------------------

class _Tokens:
    """The new tokens of one row, indexed as ``state.token_ids[start:start + n]``."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, index: slice) -> list[int]:
        assert index.start == self.start and index.stop == self.start + len(self.tokens), index
        return self.tokens


@dataclass
class _Row:
    """What ``ModelRunner`` reads of one ``RequestState``."""

    num_computed_tokens: int
    block_ids: list[int]
    token_ids: _Tokens
    num_tokens: int


@dataclass
class StepRows:
    """What ``ModelRunner.execute`` reads of a ``ScheduledBatch``: per entry its first new
    position, block table, new tokens and the request's known token count (``completes``)."""

    requests: list[_Row]
    num_new_tokens: list[int]

    @classmethod
    def of(cls, batch) -> StepRows:
        rows = [_Row(s.num_computed_tokens, list(s.block_ids),
                     _Tokens(s.num_computed_tokens,
                             list(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n])),
                     s.num_tokens)
                for s, n in zip(batch.requests, batch.num_new_tokens)]
        return cls(rows, list(batch.num_new_tokens))

    def completes(self, i: int) -> bool:
        row = self.requests[i]
        return row.num_computed_tokens + self.num_new_tokens[i] == row.num_tokens


class DriverRunner:
    """Rank 0's ``ModelRunner``: broadcasts each step's ``StepRows``, then runs its own shard.
    With a layer listener, every rank stops after each layer in a window where the listener
    may read or write KV (``InstanceKVStore``); the listener's exception is held until the
    forward ends, so every rank runs the same collectives, then raised."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup) -> None:
        self.runner, self.group = runner, group

    in_step = False  # True while a forward runs outside a between-layers window

    def execute(self, batch, on_layer_done=None) -> torch.Tensor:
        self.group.broadcast_object(("step", (StepRows.of(batch), on_layer_done is not None)))
        held: list[BaseException] = []

        def between_layers(layer: int) -> None:
            self.in_step = False
            try:
                if not held:
                    on_layer_done(layer)
            except Exception as err:  # held: the other ranks still run this forward
                held.append(err)
            finally:
                self.group.broadcast_object(("layer_done", layer))
                self.in_step = True

        self.in_step = True
        try:
            logits = self.runner.execute(batch, on_layer_done and between_layers)
        finally:
            self.in_step = False
        if held:
            raise held[0]
        return logits

    def __getattr__(self, name):
        return getattr(self.runner, name)


def _read_local(store: KVStore, group: TensorParallelGroup, block_ids: list[int],
                num_tokens: int, layers: slice) -> list[torch.Tensor] | None:
    """Every rank's ``store.read`` of one request (its own heads), gathered on rank 0 (rank
    order; None on the others)."""
    return group.gather(store.read(block_ids, num_tokens, layers))


def _write_local(store: KVStore, group: TensorParallelGroup, block_ids: list[int],
                 shape: tuple[int, ...], layer_start: int,
                 kv: torch.Tensor | None = None) -> None:
    """Write one request's ``[L', 2, H_kv, T, D]`` KV (``shape``), each rank exactly its own
    heads, scattered from rank 0's ``kv``."""
    def heads_of(rank: int) -> range:
        return kv_heads_of(rank, group.size, shape[2])

    mine = heads_of(group.rank)
    local = torch.empty(shape[:2] + (len(mine),) + shape[3:], dtype=store.spec.torch_dtype)
    parts = None if kv is None else [kv[:, :, heads_of(r).start:heads_of(r).stop].contiguous()
                                     for r in range(group.size)]
    group.scatter(local, parts)
    store.write(block_ids, local, layer_start)


def _on_rank(store: KVStore, group: TensorParallelGroup, fn, args: tuple,
             **here) -> list[tuple[bool, object]] | None:
    """``fn(store, group.rank, *args, **here)`` here; each rank's ``(True, result)`` or
    ``(False, "ErrorType: message")`` gathered on rank 0 (a failure never skips the gather)."""
    try:
        outcome = (True, fn(store, group.rank, *args, **here))
        pickle.dumps(outcome)  # an unpicklable result fails here, not inside the gather
    except Exception as err:
        outcome = (False, f"{type(err).__name__}: {err}")
    return group.gather_object(outcome)


class InstanceKVStore:
    """Rank 0's view of a TP instance's KV: ``read`` and ``write`` take and give every KV
    head (``[L', 2, H_kv, T, D]``), each rank handling its own heads of the same blocks;
    ``each_rank`` runs a function on every rank's own store; anything else is rank 0's
    store's. They are collectives: between steps, or in a forward only in the window after a
    layer; elsewhere in a forward they raise ``RuntimeError``.
    """

    def __init__(self, local: KVStore, spec, group: TensorParallelGroup, driver: DriverRunner):
        self.local, self.spec, self.group, self.driver = local, spec, group, driver

    def _outside_step(self, what: str) -> None:
        if self.driver.in_step:
            raise RuntimeError(f"KV {what} of a TP {self.group.size} instance inside a "
                               "forward, outside the window after a layer")

    def read(self, block_ids: list[int], num_tokens: int, layers: slice = slice(None),
             may_view: bool = False) -> torch.Tensor:
        """One request's KV, every head: ``[L', 2, H_kv, T, D]``, contiguous, always a new
        tensor (the heads are gathered from the ranks, whatever ``may_view``)."""
        self._outside_step("read")
        block_ids = list(block_ids)
        self.group.broadcast_object(("read", (block_ids, num_tokens, layers)))
        parts = _read_local(self.local, self.group, block_ids, num_tokens, layers)
        whole = parts[0].new_empty(parts[0].shape[:2] + (self.spec.num_kv_heads,) + parts[0].shape[3:])
        for rank, part in enumerate(parts):  # a replicated head: every copy is the same
            heads = kv_heads_of(rank, self.group.size, self.spec.num_kv_heads)
            whole[:, :, heads.start:heads.stop] = part
        return whole

    def write(self, block_ids: list[int], kv: torch.Tensor, layer_start: int = 0) -> None:
        """Place every head's ``kv`` ``[L', 2, H_kv, T, D]`` into a request's blocks, each rank
        its own heads (``KVStore.write``'s checks and errors, on rank 0 first)."""
        self._outside_step("write")
        expected = self.spec.kv_shape(kv.shape[3], kv.shape[0])
        if tuple(kv.shape) != expected or kv.dtype != self.spec.torch_dtype:
            raise ValueError(f"KV tensor mismatch: expected shape {expected} dtype "
                             f"{self.spec.torch_dtype}, got {tuple(kv.shape)} {kv.dtype}")
        block_ids = list(block_ids)
        self.group.broadcast_object(("write", (block_ids, tuple(kv.shape), layer_start)))
        _write_local(self.local, self.group, block_ids, tuple(kv.shape), layer_start, kv)

    def each_rank(self, fn, *args, **here) -> list[tuple[bool, object]]:
        """``fn(store, rank, *args)`` on every rank's own ``KVStore`` (``here``: rank 0's
        extra keywords): ``(ok, result or "ErrorType: message")`` per rank. ``fn`` is
        module-level, ``args`` picklable, no collective inside. Windows as ``read``'s."""
        self._outside_step("op")
        self.group.broadcast_object(("each_rank", (fn, args)))
        return _on_rank(self.local, self.group, fn, args, **here)

    def __getattr__(self, name):
        return getattr(self.local, name)


def make_engine(loaded: LoadedModel, config, group: TensorParallelGroup, **engine_kwargs):
    """Rank 0 of an instance: an ``Engine`` over rank 0's shard whose runner drives the other
    ranks (``DriverRunner``), its block count sent to them. Its ``kv_spec`` is the whole
    model's and its ``kv_store`` an ``InstanceKVStore``, so it exchanges KV with an instance
    of any TP in the same wire format. ``config.device`` is rank 0's; the KV budget is per
    rank. Call ``group.stop()`` when done.
    """
    shard = shard_loaded(loaded, 0, group.size)
    engine = Engine(shard, config, **engine_kwargs)
    group.broadcast_object(engine.kv_store.num_blocks)
    if group.size > 1:
        _wrap_row_parallel(engine.runner, group)
        engine.runner = DriverRunner(engine.runner, group)
        engine.kv_store = InstanceKVStore(engine.kv_store, loaded.kv_spec, group, engine.runner)
        engine.kv_spec = loaded.kv_spec  # the instance's KV: every head (transfers, checks)
    return engine


def _serve_window(store: KVStore, group: TensorParallelGroup) -> None:
    """After a layer of a step with a layer listener: serve rank 0's KV reads and writes
    until it closes the window (``DriverRunner``)."""
    while True:
        op, args = group.broadcast_object()
        if op == "layer_done":
            return
        if op not in _STORE_OPS:
            raise ValueError(f"instance command {op!r} inside a forward")
        _STORE_OPS[op](store, group, *args)


# the KV-store commands rank 0 broadcasts, inside a forward's windows or between steps alike
_STORE_OPS = {"read": _read_local, "write": _write_local, "each_rank": _on_rank}


def follow(loaded: LoadedModel, config, group: TensorParallelGroup) -> int:
    """Rank ``group.rank`` > 0 on ``config.device``: shard ``loaded``, build its KV store with
    rank 0's block count, run every command rank 0 broadcasts until ``stop``; the steps run.

    Raises:
        RuntimeError: a collective failed (a rank died; after the group's timeout).
    """
    shard = shard_loaded(loaded, group.rank, group.size)
    num_blocks = group.broadcast_object()
    store = KVStore(shard.kv_spec, num_blocks, config.block_size, config.device)
    runner = parallel_runner(shard, store, config.device, group)
    steps = 0
    while (message := group.broadcast_object()) is not None:
        op, args = message
        if op == "step":
            rows, windows = args
            runner.execute(rows, (lambda layer: _serve_window(store, group)) if windows else None)
            steps += 1
        elif op in _STORE_OPS:
            _STORE_OPS[op](store, group, *args)
        else:
            raise ValueError(f"unknown instance command {op!r}")
    return steps


def connect(init_method: str, rank: int, size: int, backend: str = "gloo",
            timeout_s: float = 120.0, store=None) -> TensorParallelGroup:
    """Join an instance's group through ``init_method`` ``store://host:port`` (rank 0 may pass
    its ``store`` itself); ValueError on another form."""
    if store is None:
        store = _store_client(init_method, timeout_s)
    return TensorParallelGroup(store, rank, size, backend, timeout_s)


def _store_client(init_method: str, timeout_s: float):
    """A client of the rendezvous at ``store://host:port``; ValueError on another form."""
    host, sep, port = init_method.removeprefix("store://").rpartition(":")
    if not init_method.startswith("store://") or not sep or not port.isdigit():
        raise ValueError(f"init_method must be store://host:port, got {init_method!r}")
    return dist.TCPStore(host, int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _await_ranks(store, processes: list, timeout_s: float) -> None:
    """Wait until every spawned rank says ``ready``; RuntimeError naming a rank that said
    ``failed`` (its error quoted), exited, or neither within ``timeout_s``."""
    waiting = dict(enumerate(processes, start=1))
    deadline_s = time.monotonic() + timeout_s
    while waiting:
        for rank, process in list(waiting.items()):
            if store.check([f"failed/{rank}"]):
                raise RuntimeError(f"rank {rank} failed to start: "
                                   f"{store.get(f'failed/{rank}').decode()}")
            if store.check([f"ready/{rank}"]):
                del waiting[rank]
            elif not process.is_alive():
                raise RuntimeError(f"rank {rank} exited while starting (exit code "
                                   f"{process.exitcode})")
        if waiting and time.monotonic() > deadline_s:
            raise RuntimeError(f"ranks {sorted(waiting)} did not start within {timeout_s:g} s")
        time.sleep(0.02)


def serve_rank(model_config, engine_config, init_method: str, rank: int, size: int,
               backend: str | None = None, timeout_s: float = 120.0,
               device: str | None = None) -> int:
    """A process's life as rank ``rank`` > 0: bind to ``device`` (None:
    ``engine_config.device``), load the model, tell the rendezvous ``ready/<rank>`` (or
    ``failed/<rank>`` with the error), join the group (``backend`` None: ``backend_for``),
    ``follow`` until rank 0 stops; the steps run. A ``cpu:`` device first takes its own
    cores, since a spawned rank inherits rank 0's pinning."""
    store = _store_client(init_method, timeout_s)
    try:
        if device is not None:
            if device.startswith("cpu:"):
                try:
                    os.sched_setaffinity(0, cpu_cores_of(device))
                except OSError:  # cores this machine lacks: bind_device names them
                    pass
            engine_config = replace(engine_config, device=bind_device(device))
        elif engine_config.device == "cpu":
            torch.set_num_threads(1)
        loaded = load_model(model_config, engine_config.device)
    except Exception as err:
        store.set(f"failed/{rank}", f"{type(err).__name__}: {err}")
        raise
    store.set(f"ready/{rank}", "1")
    group = connect(init_method, rank, size, backend or backend_for(engine_config.device),
                    timeout_s, store=store)
    try:
        return follow(loaded, engine_config, group)
    finally:
        group.close()


def _rank_process(*args) -> None:
    """``start_instance``'s spawn target: ``serve_rank(*args)``, then exit 0 (or 1 after
    printing the error) without the interpreter's teardown, where a gloo destructor can
    abort the process (SIGABRT) and read as a failed rank."""
    code = 0
    try:
        serve_rank(*args)
    except BaseException:  # printed here: os._exit skips the default report
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@dataclass
class RunningInstance:
    """A TP instance started by ``start_instance``: rank 0's ``engine`` in this process, the
    other ranks' processes, and the rendezvous that keeps their group."""

    engine: Engine
    group: TensorParallelGroup
    processes: list
    rendezvous: object

    def dead_rank(self) -> str | None:
        """``TP rank 1 (pid 42) exited with code -9`` for a rank that ended; None if none."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return f"TP rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def close(self, timeout_s: float = 60.0) -> list[int | None]:
        """Stop the other ranks and wait for them; a rank still running after ``timeout_s``
        is killed. Returns their exit codes (0: a clean stop)."""
        try:  # with a rank gone the stop could wait out the group's timeout: kill instead
            if self.group.size > 1 and self.dead_rank() is None:
                self.group.stop()
        except RuntimeError:  # a rank died meanwhile: the others are killed below
            pass
        if self.dead_rank() is not None:
            for p in self.processes:
                p.kill()
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout_s)
        self.group.close()
        return [p.exitcode for p in self.processes]


def start_instance(loaded: LoadedModel, model_config, engine_config, tp: int,
                   devices: tuple[str, ...] | None = None, timeout_s: float = 120.0,
                   **engine_kwargs) -> RunningInstance:
    """Start a TP-``tp`` instance: ranks 1.. spawned (``serve_rank`` on ``devices[r]``),
    rank 0 here (already on ``devices[0]``), over a rendezvous hosted on 127.0.0.1.

    Raises:
        ValueError: ``devices`` not ``tp`` long, or ``make_engine``'s refusals (the other
            ranks are stopped first).
        RuntimeError: a rank failed to start (its error quoted: e.g. a device it cannot
            bind, a model it cannot load), exited, or did not start within ``timeout_s``.
    """
    if devices is not None and len(devices) != tp:
        raise ValueError(f"a TP {tp} instance needs {tp} devices, got {len(devices)}: {devices}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    init_method = f"store://127.0.0.1:{store.port}"
    backend = backend_for(engine_config.device)
    ctx = torch.multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=_rank_process, daemon=True, name=f"tp-rank-{r}",
                             args=(model_config, engine_config, init_method, r, tp, backend,
                                   timeout_s, None if devices is None else devices[r]))
                 for r in range(1, tp)]
    for p in processes:
        p.start()
    group = None
    try:
        _await_ranks(store, processes, timeout_s)
        group = connect(init_method, 0, tp, backend, timeout_s, store=store)
        engine = make_engine(loaded, engine_config, group, **engine_kwargs)
    except BaseException:
        for p in processes:
            p.join(timeout_s if group is not None else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout_s)
        raise
    return RunningInstance(engine, group, processes, store)
