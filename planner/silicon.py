"""GPU device profiles without a GPU: pdlab's step models fitted on AIConfigurator, NVIDIA's
measured per-operation database (H100, H200, B200, GB200, ... under vLLM, SGLang and TRT-LLM; no
torch; the optional extra ``silicon``), calling its backends' ``run_static`` and ``run_mixed``:
``open_database`` (one instance of TP ``tp``: the database's Megatron-style split, GEMMs over
``tp`` GPUs and two all-reduces per layer, its own step times; what the database lacks, MoE or an unknown KV dtype raise
``SiliconError``), ``sample_steps`` (prefill, decode at Σctx = B(C + 1), mixed: one prompt of P
beside B decodes at P + 1), ``build_profile`` (``fit_step_models`` on them, the system's own link
figures, ``DeviceProfile.source``). Left out, as by the database's static steps: vLLM's
per-request CPU dispatch overhead. The ``agg`` TPOT averages mixed and decode steps, so it
matches pdlab's decode model only at B = 1."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import math
import re
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import TRANSPORTS
from engine.placement import check_tp
from planner.latency import (LINKS, DeviceProfile, StepFeatures, fit_step_models, link_transfer)

BACKENDS = ("vllm", "sglang", "trtllm")
PACKAGE = "aiconfigurator-core"
PACKAGE_VERSION = "0.12.0"  # pinned: its successor aisimulate 0.13 builds only where nvidia-smi runs
INSTALL_HINT = "pip install 'pdlab[silicon]' (aiconfigurator==0.12.0, aiconfigurator-core==0.12.0)"
# pdlab's KV dtypes by the database's KV-cache quant mode name
_KV_DTYPES = {"bfloat16": "bfloat16", "float16": "float16"}


class SiliconError(ValueError):
    """A one-line refusal: the database lacks the system, backend or a shape of the model,
    or the optional package is not installed."""


@dataclass(frozen=True)
class SampleGrid:
    """The steps ``sample_steps`` asks for; the defaults cover a 7-8B model on one GPU: decode
    up to vLLM's ``max_num_seqs`` 256 at contexts to 8k, prefill of 1-4 prompts to 16k tokens,
    chunks over up to 6k cached. All in tokens; ``chunks``: ``(k, n)``, n new over k cached;
    ``contexts``: C, KV tokens before the step; prefill steps of m x P over
    ``max_prefill_tokens`` are skipped."""

    prompt_lens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    prompts_per_step: tuple[int, ...] = (1, 2, 4)
    max_prefill_tokens: int = 16384
    chunks: tuple[tuple[int, int], ...] = ((512, 512), (2048, 512), (2048, 2048), (6144, 2048))
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    contexts: tuple[int, ...] = (128, 512, 1024, 2048, 4096, 8192)
    mixed_prompts: tuple[int, ...] = (256, 512, 2048)
    mixed_batch_sizes: tuple[int, ...] = (1, 8, 32, 64)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The package's loggers at ERROR (it warns about other models' fallback tables on load)."""
    loggers = [logging.getLogger(n) for n in ("aiconfigurator_core", "aiconfigurator")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _aic() -> Any:
    """The ``aiconfigurator_core.sdk`` modules the builder uses, as one namespace.

    Raises:
        SiliconError: the optional package is missing or not the pinned version."""
    try:
        # lazy: the optional extra `silicon`; pdlab profile's CPU path and the planner run without it
        from aiconfigurator_core.sdk import config, config_builders, errors, models, perf_database
        from aiconfigurator_core.sdk.backends import factory
        from aiconfigurator_core.sdk.step_estimate import MixedStepInput
    except ImportError as err:
        raise SiliconError(f"the silicon database needs the optional package {PACKAGE} "
                           f"({err.name or err}): {INSTALL_HINT}") from None
    version = importlib.metadata.version(PACKAGE)
    if version != PACKAGE_VERSION:
        raise SiliconError(f"{PACKAGE} {version} is installed, pdlab reads {PACKAGE_VERSION}: "
                           f"{INSTALL_HINT}")
    return types.SimpleNamespace(config=config, config_builders=config_builders, errors=errors,
                                 models=models, perf_database=perf_database, factory=factory,
                                 MixedStepInput=MixedStepInput)


def supported_databases() -> dict[str, dict[str, list[str]]]:
    """``{system: {backend: [database versions]}}`` of the installed package.

    Raises:
        SiliconError: the package is not installed."""
    aic = _aic()
    return {s: {b: list(v) for b, v in versions.items()}
            for s, versions in _scan(aic.perf_database).items()}


# The package parses hundreds of YAML files per lookup: once per process.
@functools.cache
def _scan(perf_database) -> dict[str, dict[str, tuple[str, ...]]]:
    with quiet():
        found = perf_database.get_supported_databases()
    return {s: {b: tuple(v) for b, v in found[s].items()} for s in sorted(found)}


@functools.cache
def _default_version(perf_database, system: str, backend: str) -> str | None:
    """``get_latest_database_version``'s first rule (the slots' ``current``), else its answer."""
    with quiet():
        slots = perf_database.get_version_slots(system, backend)
        if slots and slots.get("current") in _scan(perf_database).get(system, {}).get(backend, ()):
            return slots["current"]
        return perf_database.get_latest_database_version(system=system, backend=backend)


def check_system(system: str, backend: str) -> None:
    """The database has ``backend`` on ``system``.

    Raises:
        SiliconError: naming the systems (or the system's backends) it has."""
    if backend not in BACKENDS:
        raise SiliconError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    found = supported_databases()
    if system not in found:
        raise SiliconError(f"unknown system {system!r}: the {PACKAGE} {PACKAGE_VERSION} "
                           f"database has {', '.join(found)}")
    if backend not in found[system]:
        raise SiliconError(f"system {system} has no {backend} data in the database (it has "
                           f"{', '.join(sorted(found[system]))})")


def read_model_config(model_dir: str | Path) -> dict:
    """The ``config.json`` of a Hugging Face model directory.

    Raises:
        SiliconError: no such directory, no ``config.json``, or not JSON."""
    path = Path(model_dir).expanduser() / "config.json"
    if not path.parent.is_dir():
        raise SiliconError(f"model directory {path.parent} does not exist (a directory with "
                           "a config.json, e.g. engine/configs/llama-3.1-8b)")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SiliconError(f"{path.parent} has no config.json: the silicon database shapes "
                           "a model from its Hugging Face config file") from None
    except (OSError, ValueError) as err:
        raise SiliconError(f"cannot read {path}: {err}") from None


_KEY_WORDS = {"head_size": "head size {}", "n_kv_lookup": "{} KV heads",
              "kv_quant": "KV in {}", "fmha_quant": "attention in {}", "window_size": None}


def missing_data_message(err: BaseException, where: str) -> str:
    """One line for the database's "data missing" error (which table and shape), e.g.
    ``h100_sxm/vllm 0.24.0 has no generation attention data for head size 64 (3 KV heads, KV in
    bfloat16)``; another message keeps its first clause."""
    text = str(err)
    found = re.search(r"([\w ]+?) data missing for \w+ \{([^}]*)\}", text)
    if not found:
        return f"{where}: {text.split(': tried')[0].splitlines()[0]}"
    fields = dict(re.findall(r"(\w+): \"?([^,\"]+)\"?", found.group(2)))
    known = [_KEY_WORDS[k].format(fields[k].strip()) for k in _KEY_WORDS
             if k in fields and _KEY_WORDS[k] is not None]
    words = known + [f"{k} {v.strip()}" for k, v in fields.items() if k not in _KEY_WORDS]
    table = found.group(1).strip().removeprefix("perf database error: ")
    shape = words[0] + (f" ({', '.join(words[1:])})" if len(words) > 1 else "") if words \
        else found.group(2).strip()
    return f"{where} has no {table} data for {shape}"


@dataclass
class SiliconDatabase:
    """One model on one TP-``tp`` instance in the database (``open_database``). ``kv_dtype``:
    pdlab's name; ``node``: the system spec's ``node`` (bytes/s, ``p2p_latency`` s);
    ``kv_bytes_per_token``: the database's own on one GPU (``get_kvcache_bytes_per_sequence(1)``,
    the GPU's share at TP ``tp``)."""

    model_dir: str
    system: str
    backend: str
    version: str
    kv_dtype: str
    gemm_dtype: str
    node: dict
    kv_bytes_per_token: int
    tp: int
    _aic: Any = field(repr=False)
    _model: Any = field(repr=False)
    _database: Any = field(repr=False)
    _backend: Any = field(repr=False)

    def device_memory_bytes(self) -> int:
        """The GPU's memory in bytes (the spec's ``gpu.mem_capacity``)."""
        return int(self._database.system_spec["gpu"]["mem_capacity"])

    def weight_bytes(self) -> int:
        """The model's weights on one GPU of the instance in bytes, by the database's memory
        model."""
        memory = self._backend._get_memory_usage(
            self._model, self._database, batch_size=1, beam_width=1, isl=1, osl=1,
            num_tokens=1, prefix=0, max_seq_len=1, mtp_activation_scaling=False)
        return int(float(memory["weights"]) * (1 << 30))

    @property
    def where(self) -> str:
        return f"{self.system}/{self.backend} {self.version}" + (f" TP {self.tp}" if self.tp > 1 else "")

    def _ms(self, call) -> float:
        try:
            with quiet():
                return float(call())
        except self._aic.errors.PerfDataNotAvailableError as err:
            raise SiliconError(missing_data_message(err, self.where)) from None

    def _static(self, mode: str, batch_size: int, isl: int, osl: int, prefix: int = 0) -> dict:
        runtime = self._aic.config.RuntimeConfig(batch_size=batch_size, isl=isl, osl=osl,
                                                 prefix=prefix)
        return self._backend.run_static(self._model, self._database, runtime,
                                        mode).get_result_dict()

    def prefill_s(self, num_prompts: int, prompt_len: int, cached_len: int = 0) -> float:
        """Seconds of one prefill step of ``num_prompts`` x ``prompt_len`` new tokens over
        ``cached_len`` cached ones (``static_ctx`` TTFT)."""
        return self._ms(lambda: self._static("static_ctx", num_prompts, cached_len + prompt_len,
                                             1, cached_len)["ttft"]) / 1e3

    def decode_s(self, batch_size: int, context_len: int) -> float:
        """Seconds of one decode step at ``context_len`` (``static_gen``, osl 2)."""
        return self._ms(lambda: self._static("static_gen", batch_size, context_len, 2)["tpot"]) / 1e3

    def mixed_s(self, prompt_len: int, batch_size: int) -> float:
        """Seconds of a whole prompt beside ``batch_size`` decodes at ``prompt_len + 1`` (``run_mixed``)."""
        runtime = self._aic.config.RuntimeConfig(batch_size=1, isl=prompt_len, osl=1)
        step = self._aic.MixedStepInput(context_tokens=prompt_len, num_decode_requests=batch_size)
        return self._ms(lambda: self._backend.run_mixed(self._model, self._database, runtime,
                                                        step).latency_ms) / 1e3

    def tpot_s(self, batch_size: int, isl: int, osl: int) -> float:
        """The database's TPOT in seconds (``estimate-mode static_gen``: steps every 32 tokens)."""
        return self._ms(lambda: self._static("static_gen", batch_size, isl, osl)["tpot"]) / 1e3


def open_database(model_dir: str | Path, system: str, backend: str, tp: int = 1) -> SiliconDatabase:
    """The database's view of ``model_dir`` on an instance of ``tp`` GPUs of ``system`` under
    ``backend`` (tensor parallel), probed with one decode and one prefill step so a missing
    shape is refused here. Whether the weights fit is ``engine.memory_fit``'s question.

    Raises:
        SiliconError: the package is missing, an unknown system or backend, no config file,
            a TP the model's heads do not allow (``engine.placement.check_tp``), a MoE model, a
            KV dtype pdlab has not, or data missing for the model's shapes."""
    aic = _aic()
    check_system(system, backend)
    hf = read_model_config(model_dir)
    heads = int(hf["num_attention_heads"])
    try:
        check_tp(tp, heads, int(hf.get("num_key_value_heads", heads)), model=str(model_dir))
    except ValueError as err:
        raise SiliconError(str(err)) from None
    path = str(Path(model_dir).expanduser())
    where = f"{system}/{backend}"
    try:
        with quiet():
            if aic.models.check_is_moe(path):
                raise SiliconError(f"{path} is a mixture-of-experts model: pdlab profiles "
                                   "dense models (one GPU, no expert parallelism)")
            version = _default_version(aic.perf_database, system, backend)
            where = f"{system}/{backend} {version}"
            database = aic.perf_database.get_database_view(
                system, backend, version, allow_missing_data=False, database_mode="SILICON",
                transfer_policy=None)
            if database is None:
                raise SiliconError(f"the {where} database could not be loaded")
            config = aic.config_builders.build_model_config(tp, 1, 1, 1, 1)
            aic.models.resolve_context_fmha_by_data(config, path, database, backend,
                                                    is_context_role=True)
            model = aic.models.get_model(path, config, backend)
            kv_bytes = int(model.get_kvcache_bytes_per_sequence(1))
    except aic.errors.PerfDataNotAvailableError as err:
        raise SiliconError(missing_data_message(err, where)) from None
    except (ValueError, KeyError, NotImplementedError) as err:
        if isinstance(err, SiliconError):
            raise
        raise SiliconError(f"{where} cannot model {path}: {str(err).splitlines()[0]}") from None
    kv_mode = model.config.kvcache_quant_mode.name
    if kv_mode not in _KV_DTYPES:
        raise SiliconError(f"{where} estimates {path} with its KV cache in {kv_mode}: pdlab's "
                           f"KV dtypes are {', '.join(_KV_DTYPES)}")
    db = SiliconDatabase(path, system, backend, str(version), _KV_DTYPES[kv_mode],
                         model.config.gemm_quant_mode.name, dict(database.system_spec["node"]),
                         kv_bytes, tp, aic, model, database, aic.factory.get_backend(backend))
    db.decode_s(1, 128)
    db.prefill_s(1, 128)
    return db


def sample_steps(db: SiliconDatabase, grid: SampleGrid = SampleGrid()
                 ) -> tuple[list[tuple[StepFeatures, float]], list[tuple[StepFeatures, float]],
                            list[tuple[StepFeatures, float]]]:
    """``(features, seconds)`` of the database's steps on ``grid``, in ``fit_step_models``' order.

    Raises:
        SiliconError: data missing for a shape of the grid."""
    F = StepFeatures
    prefill = [(F(m * p, m * p * p), db.prefill_s(m, p))
               for p in grid.prompt_lens for m in grid.prompts_per_step
               if m * p <= grid.max_prefill_tokens]
    prefill += [(F(n, n * (k + n)), db.prefill_s(1, n, k)) for k, n in grid.chunks]
    decode = [(F(batch_size=b, sum_context=b * (c + 1)), db.decode_s(b, c))
              for b in grid.batch_sizes for c in grid.contexts]
    mixed = [(F(p, p * p, b, b * (p + 1)), db.mixed_s(p, b))
             for p in grid.mixed_prompts for b in grid.mixed_batch_sizes]
    return prefill, decode, mixed


def build_profile(db: SiliconDatabase, model_name: str, kv_bytes_per_token: int,
                  link: str | None = None, grid: SampleGrid = SampleGrid(),
                  created: str = "", device_kv_bytes_per_token: int | None = None) -> DeviceProfile:
    """The ``DeviceProfile`` of ``db``'s TP-``db.tp`` instance (PP 1). Transfers: each ``LINKS``
    link the system has, and ``link``'s (default nvlink where present, else pcie) under every
    transport name: on that box KV crosses that link whichever transport moves it.
    ``kv_bytes_per_token`` (the whole model's, what a transfer moves) and
    ``device_kv_bytes_per_token`` (one GPU's share; None: the whole) at ``db.kv_dtype``.

    Raises:
        SiliconError: data missing for a shape of the grid.
        ValueError: an unknown link, or ``nvlink`` on a system without it."""
    links = {}
    for name in LINKS:
        try:
            links[name] = link_transfer(name, db.node)
        except ValueError:
            continue  # nvlink on a PCIe-only system
    link = link or ("nvlink" if "nvlink" in links else "pcie")
    try:
        chosen = link_transfer(link, db.node)
    except ValueError as err:
        raise ValueError(f"--link {link} on {db.system}: {err}") from None
    prefill, decode, mixed = sample_steps(db, grid)
    pre, dec, mix = fit_step_models(prefill, decode, mixed)
    package = f"{PACKAGE} {importlib.metadata.version(PACKAGE)}"
    return DeviceProfile(
        model=model_name, dtype=db.kv_dtype, device_kind="cuda", device_name=db.system,
        num_threads=0, kv_bytes_per_token=int(kv_bytes_per_token),
        prefill=pre, decode=dec, mixed=mix,
        transfers={**links, **{t: chosen for t in TRANSPORTS}},
        notes={"estimator": f"{package} {db.where} database, SILICON mode, static step "
                            "estimates (no CPU dispatch overhead), "
                            + (f"TP {db.tp} over {db.tp} GPUs" if db.tp > 1 else "one GPU"),
               "gemm_dtype": db.gemm_dtype, "link": link,
               "transports": f"{', '.join(TRANSPORTS)} carry the {link} model",
               "num_threads": "0: no step ran on this machine", "created": created},
        max_prefill_tokens=max(f.prefill_tokens for f, _ in prefill),
        device_memory_bytes=db.device_memory_bytes(), weight_bytes=db.weight_bytes(),
        source={"kind": "aiconfigurator", "package": package, "system": db.system,
                "backend": db.backend, "database_version": db.version,
                "database_mode": "SILICON", "link": link, "model_config": db.model_dir},
        tp=db.tp, device_kv_bytes_per_token=device_kv_bytes_per_token)


def mean_decode_step_s(profile: DeviceProfile, batch_size: int, isl: int, osl: int) -> float:
    """pdlab's TPOT: the mean of the profile's ``osl - 1`` decode steps, the j-th at KV context
    ``isl + j``, as an emulated device holds them.

    Raises:
        ValueError: ``osl`` < 2 (no decode step)."""
    if osl < 2:
        raise ValueError(f"osl must be >= 2 for a decode step, got {osl}")
    step = profile.step_time()
    return math.fsum(step(0, 0, batch_size, batch_size * (isl + j + 1))
                     for j in range(osl - 1)) / (osl - 1)


def decode_table(profile: DeviceProfile, db: SiliconDatabase,
                 batch_sizes: Sequence[int] = (1, 16, 64), isl: int = 512,
                 osl: int = 64) -> list[dict]:
    """Rows ``batch_size, isl, osl, pdlab_s, database_s, error`` (pdlab / database - 1)."""
    rows = []
    for b in batch_sizes:
        ours, theirs = mean_decode_step_s(profile, b, isl, osl), db.tpot_s(b, isl, osl)
        rows.append({"batch_size": b, "isl": isl, "osl": osl, "pdlab_s": ours,
                     "database_s": theirs, "error": ours / theirs - 1.0})
    return rows
