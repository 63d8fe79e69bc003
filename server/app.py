"""``pdlab serve``: an OpenAI-compatible HTTP server over any placement (FastAPI + uvicorn).
Its part of a request's life (the whole story: docs/architecture.md, "A request's life"):

1. The body is read with a size cap (``max_body_bytes``: 413), decoded as strict UTF-8, parsed
   as JSON and validated by pydantic models that forbid unknown fields and coerce no types.
2. The prompt becomes token ids. Empty prompts, ``prompt + max_tokens`` over the context or a
   worker's whole KV cache, ids outside the vocabulary and bad sampling values are refused
   before anything is queued.
3. ``n`` choices are ``n`` router requests; ``usage.prompt_tokens`` counts the prompt once.
4. ``Router.submit`` streams token ids; ``TextStream`` turns them into text and matches ``stop``
   strings across tokens (the request is then aborted). Streaming is one server-sent event per
   output token, the usage chunk when asked, then ``data: [DONE]``. Logprobs are raw
   (``log_softmax`` before any filter). A client that disconnects gets its requests aborted.

Errors: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with 400 (404 an unknown
model, 413 a body over the cap), the connection kept; no live worker: 503, with ``Retry-After``
while a restart is under way; a failed generation 500; anything unexpected a JSON 500 with
``Connection: close``. ``/metrics`` is Prometheus text with vLLM's metric names under ``pdlab:``
(TTFT, ITL, E2E, queue time, running and waiting, tokens, prefix cache), KV transfer histograms,
and ``pdlab:worker_info`` / ``worker_load_tokens`` (``engine.metrics``)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from engine import metrics as m
from engine.errors import describe_error
from engine.metrics import RequestRecord
from engine.request import MAX_LOGPROBS, Request, SamplingParams
from server.config import LOOPBACK
from server.text import ByteText, HFText, Text, TextStream
from router.router import FINISH, Router, StreamEvent

_LOG = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 16  # prompts in one completions request
RETRY_AFTER_S = 2  # 503's Retry-After while a worker restarts (seconds)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """``null`` means "not given": the field keeps its default (a required one is missing)."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


def _check_stop(value: Any) -> list[str]:
    """``stop``: a string or a list of at most ``MAX_STOP_STRINGS`` non-empty strings."""
    if isinstance(value, str):
        return [value] if value else []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("stop must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    if not all(value):
        raise ValueError("stop strings must not be empty")
    return list(value)


def _token_ids(value: list, what: str) -> list[int]:
    """A list of token ids (integers >= 0; booleans are not integers here)."""
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{what} must be integers")
    bad = [t for t in value if t < 0]
    if bad:
        raise ValueError(f"{what} must be >= 0, got {bad[0]}")
    return value


def _check_prompt(value: Any) -> list[str | list[int]]:
    """``prompt`` as a list of prompts (strings or token-id lists), at most ``MAX_PROMPTS``."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "or a list of lists of token ids")
    if not value:
        raise ValueError("prompt must not be empty (an empty list)")
    if all(isinstance(v, str) for v in value):
        prompts = list(value)
    elif all(isinstance(v, list) for v in value):
        prompts = [_token_ids(v, "prompt token ids") for v in value]
        if not all(prompts):
            raise ValueError("prompt must not be empty (an empty list of token ids)")
    else:
        return [_token_ids(value, "prompt token ids")]
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"prompt takes at most {MAX_PROMPTS} prompts in one request, got "
                         f"{len(prompts)}")
    return prompts


class _Sampling(_Body):
    """The request fields both endpoints take; ``null`` for any of them means "not given".

    OpenAI's fields, and vLLM's extensions (``vllm.entrypoints.openai.protocol``) with the
    meaning ``engine.request.SamplingParams`` gives them. ``max_tokens`` defaults to 16 for
    completions, to what the context and the KV cache leave for chat; ``seed``: choice ``i`` uses
    ``seed + i``; ``best_of`` only equal to ``n``; ``user`` is ignored. These are what the clients
    of tests/data/clients send. Any other field is refused (400 naming it); ``DEFAULT_ONLY``
    fields are refused unless at their default."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1 (vLLM): off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=1 << 62)] | None = None
    stop: Annotated[list[str], BeforeValidator(_check_stop)] = []
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    best_of: Annotated[int, Field(ge=1)] | None = None  # only n (no ranking of choices)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] = {}


class CompletionBody(_Sampling):
    """``/v1/completions``: ``prompt`` (a string, a list of strings, a list of token ids or
    a list of lists of token ids: ``_check_prompt``), ``logprobs`` (0..20 alternatives per
    token), ``echo`` (only false), ``suffix`` (only empty), and every ``_Sampling`` field."""

    prompt: Annotated[list[str | list[int]], BeforeValidator(_check_prompt)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # top-N per token
    echo: Literal[False] = False
    suffix: Literal[""] = ""


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]  # a list of text parts: vLLM's and GuideLLM's chat
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines (vLLM's rule)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatBody(_Sampling):
    """``/v1/chat/completions``: ``messages`` (roles system, developer, user, assistant; content a
    string or a list of ``{"type": "text", "text"}`` parts), ``max_completion_tokens`` (OpenAI's new
    name of ``max_tokens``; not both), ``logprobs`` (bool) with ``top_logprobs`` (0..20), ``tools``
    (only empty), ``tool_choice`` (only ``none``), and every ``_Sampling`` field."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # needs logprobs
    tools: Annotated[list, Field(max_length=0)] = []
    tool_choice: Literal["none"] = "none"


# fields pdlab serve takes only at their default value (a 400 names them otherwise)
DEFAULT_ONLY = ("echo", "suffix", "logit_bias", "tools", "tool_choice")


class BadRequest(Exception):
    """A request refused before anything was queued: HTTP ``status``, field ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_response(err: BadRequest) -> JSONResponse:
    """OpenAI's error object."""
    return JSONResponse({"error": {"message": err.message, "type": err.kind, "param": err.param,
                                   "code": err.status}}, status_code=err.status)


def _validation_error(err: ValidationError) -> BadRequest:
    """The first pydantic error as a BadRequest naming the field (of one field's, the deepest)."""
    errors = err.errors()
    first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]),
                key=lambda e: len(e["loc"]))
    loc = [str(p) for p in first["loc"]]
    path = [p for p in loc if p.isdigit() or p.isidentifier()]  # drop union branch names
    param = ".".join(path[:3]) if path and path[0] == "messages" else (path[0] if path else None)
    if first["type"] == "extra_forbidden":
        return BadRequest(f"unknown field {param!r}", param)
    if param in DEFAULT_ONLY:
        return BadRequest(f"{param} is not supported by pdlab serve (only its default)", param)
    if first["type"] == "value_error":  # our own checks: the message names field and limit
        return BadRequest(str(first["ctx"]["error"]), param)
    return BadRequest(f"{param}: {first['msg']}", param)


async def read_json(request: HTTPRequest, max_body_bytes: int) -> Any:
    """The JSON body, at most ``max_body_bytes`` bytes (BadRequest 413 / 400 otherwise)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body_bytes:
        raise BadRequest(f"request body of {length} bytes exceeds the limit of "
                         f"{max_body_bytes} bytes", None, 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise BadRequest(f"request body exceeds the limit of {max_body_bytes} bytes", None, 413)
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"request body is not valid UTF-8 (byte {err.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise BadRequest(f"request body is not valid JSON: {err}") from None


# vLLM's buckets (vllm/v1/metrics/loggers.py) for its latency histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
KV_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 31, 2))  # 1 KiB .. 1 GiB
KV_SECONDS_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """The ``/metrics`` families (module docstring), in a registry of their own."""

    def __init__(self, router: Router, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}
        self.ttft = Histogram("pdlab:time_to_first_token_seconds", "TTFT (router clock)",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=r).labels(**label)
        self.itl = Histogram("pdlab:inter_token_latency_seconds", "ITL (worker clock)",
                             ["model_name"], buckets=ITL_BUCKETS, registry=r).labels(**label)
        self.e2e = Histogram("pdlab:e2e_request_latency_seconds", "arrival to last token",
                             ["model_name"], buckets=E2E_BUCKETS, registry=r).labels(**label)
        self.queue = Histogram("pdlab:request_queue_time_seconds",
                               "queued on the prefill (or colocated) worker before its prompt "
                               "started computing", ["model_name"], buckets=E2E_BUCKETS,
                               registry=r).labels(**label)
        self.prompt_tokens = Counter("pdlab:prompt_tokens", "prompt tokens of answered requests",
                                     ["model_name"], registry=r).labels(**label)
        self.generation_tokens = Counter("pdlab:generation_tokens",
                                         "completion tokens of answered requests",
                                         ["model_name"], registry=r).labels(**label)
        self.success = Counter("pdlab:request_success", "answered choices by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.cache_queries = Counter("pdlab:prefix_cache_queries",
                                     "prompt tokens looked up in a prefix cache (answered requests)",
                                     ["model_name"], registry=r).labels(**label)
        self.cache_hits = Counter("pdlab:prefix_cache_hits",
                                  "prompt tokens whose prefill a prefix cache skipped",
                                  ["model_name"], registry=r).labels(**label)
        self.kv_bytes = Histogram("pdlab:kv_transfer_bytes", "prompt KV bytes shipped per request",
                                  ["prefill_worker", "decode_worker"], buckets=KV_BYTES_BUCKETS,
                                  registry=r)
        self.kv_seconds = Histogram("pdlab:kv_transfer_seconds", "KV put + get seconds per request",
                                    ["prefill_worker", "decode_worker"],
                                    buckets=KV_SECONDS_BUCKETS, registry=r)
        Gauge("pdlab:num_requests_running", "requests past their prefill, decoding",
              ["model_name"], registry=r).labels(**label).set_function(lambda: router.num_running)
        Gauge("pdlab:num_requests_waiting", "requests waiting for or in prefill",
              ["model_name"], registry=r).labels(**label).set_function(lambda: router.num_waiting)
        info = Gauge("pdlab:worker_info", "1 per live worker", ["worker", "role"], registry=r)
        load = Gauge("pdlab:worker_load_tokens", "router load of each worker (tokens)",
                     ["worker", "role"], registry=r)
        for name, worker in router.workers.items():
            info.labels(name, worker.role).set_function(lambda w=worker: float(w.alive))
            load.labels(name, worker.role).set_function(lambda n=name: router.loads.get(n, 0))
        r.register(_Restarts(router))

    def observe(self, record: RequestRecord) -> None:
        """One finished request's latencies and KV transfer (called on the router thread)."""
        if m.failed(record):
            return
        self.cache_queries.inc(record.num_prompt_tokens)
        self.cache_hits.inc(record.num_cached_prompt_tokens)
        for histogram, value in ((self.ttft, m.ttft_s(record)), (self.e2e, m.e2e_s(record)),
                                 (self.queue, m.prefill_queue_s(record))):
            if value is not None:
                histogram.observe(value)
        for gap in m.itl_s(record):
            self.itl.observe(gap)
        if record.kv_bytes and record.prefill_path == "remote":
            labels = (record.prefill_worker or "", record.decode_worker or "")
            self.kv_bytes.labels(*labels).observe(record.kv_bytes)
            if m.kv_transfer_s(record) is not None:
                self.kv_seconds.labels(*labels).observe(m.kv_transfer_s(record))


class _Restarts(Collector):
    """``pdlab:worker_restarts_total{worker, role}``: replacements that rejoined their pool."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        family = CounterMetricFamily("pdlab:worker_restarts",
                                     "restarted workers that rejoined their pool",
                                     labels=["worker", "role"])
        for name, worker in self.router.workers.items():
            family.add_metric([name, worker.role], worker.restarts)
        yield family


@dataclass
class _Choice:
    index: int
    request_id: str
    text: TextStream
    finish_reason: str | None = None
    error: str | None = None
    unavailable: bool = False  # it failed because no live worker was there for it
    finished: bool = False  # the router's finish event came
    pieces: list[str] = field(default_factory=list)
    # logprobs: one (token_id, logprob, ((token_id, logprob), ...)) per completion token
    entries: list[tuple] = field(default_factory=list)
    num_sent: int = 0  # entries already streamed
    text_offset: int = 0  # completions, streamed: text offset of the next entry


class OpenAIServer:
    """The FastAPI app over one router (whose loop starts and stops with the app).

    ``max_body_bytes``: request body cap (413 beyond). ``emulation``:
    ``experiments.results.emulation_row`` of a deployment on emulated devices, listed in
    ``/v1/models`` so a client (``pdlab bench``) can say its results are emulated; else ``{}``."""

    def __init__(self, router: Router, text: Text, model_name: str,
                 max_body_bytes: int = 1 << 20, emulation: dict | None = None) -> None:
        self.router = router
        self.emulation = dict(emulation or {})
        self.text = text
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.metrics = ServeMetrics(router, model_name)
        self.created = int(time.time())
        self.app = FastAPI(title="pdlab serve", lifespan=self._lifespan)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat_completions)
        self.app.get("/v1/models")(self.models)
        self.app.get("/health")(self.health)
        self.app.get("/metrics")(self.prometheus)
        # routing errors (unknown path 404, wrong method 405) in OpenAI's error shape too
        self.app.exception_handler(StarletteHTTPException)(self._http_error)

    @staticmethod
    async def _http_error(request, exc: StarletteHTTPException) -> JSONResponse:
        reply = error_response(BadRequest(f"{request.method} {request.url.path}: {exc.detail}",
                                          None, exc.status_code))
        reply.headers.update(exc.headers or {})  # e.g. Allow: POST on a 405
        return reply

    async def _lifespan(self, app: FastAPI):
        self.router.start()
        try:
            yield
        finally:
            self.router.stop()

    async def models(self) -> dict:
        """``GET /v1/models``: the one served model, with its context length (tokens) and,
        as vLLM, ``root`` (vLLM's client reads ``data[0]["root"]`` when given no model) and
        ``parent``; on emulated devices also ``emulated`` and ``emulation``."""
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdlab",
            "root": self.model_name, "parent": None, "max_model_len": self.router.max_model_len,
            **self.emulation}]}

    async def health(self) -> Response:
        """``GET /health``: each worker's ``state`` (``live``, ``restarting``, ``dead``),
        ``restarts`` and the ``cause`` of a worker not live; ``status`` ``ok`` (all live, 200),
        ``degraded`` (some not live, every pool still has a live worker: 200) or ``unhealthy`` (a
        pool without a live worker: 503); ``dead_workers`` lists those not live."""
        workers = list(self.router.workers.values())
        states = {w.name: {"role": w.role, "state": w.state, "restarts": w.restarts,
                           **({"cause": w.cause} if w.cause else {})} for w in workers}
        down = [w.name for w in workers if not w.alive]
        pools = {w.role for w in workers}
        served = all(any(w.alive for w in workers if w.role == role) for role in pools)
        status = "ok" if not down else "degraded" if served else "unhealthy"
        return JSONResponse({"status": status, "workers": states, "dead_workers": down},
                            status_code=200 if served else 503)

    async def prometheus(self) -> Response:
        """``GET /metrics``: Prometheus text format (module docstring lists the families)."""
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: HTTPRequest) -> Response:
        """``POST /v1/completions``: ``prompt`` a string (tokenized), a list of token ids, or
        a list of either (several prompts, ``n`` choices each)."""
        return await self._endpoint(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        """``POST /v1/chat/completions``: the messages through the model's chat template."""
        return await self._endpoint(request, chat=True)

    async def _endpoint(self, request: HTTPRequest, chat: bool) -> Response:
        """Parse, check and serve one request; the errors are the module docstring's."""
        try:
            data = await read_json(request, self.max_body_bytes)
            if chat:
                body: _Sampling = ChatBody.model_validate(data)
                prompts = [self._chat_prompt(body)]
            else:
                body = CompletionBody.model_validate(data)
                prompts = [self.text.encode(p) if isinstance(p, str) else list(p)
                           for p in body.prompt]
            return await self._serve(request, body, prompts, chat)
        except ValidationError as err:
            return error_response(_validation_error(err))
        except BadRequest as err:
            return error_response(err)
        except Exception as err:  # a bug: answer in JSON, log it, start the connection afresh
            _LOG.exception("%s %s failed", request.method, request.url.path)
            reply = error_response(BadRequest(f"internal server error: {describe_error(err)}",
                                              None, 500, "internal_error"))
            reply.headers["connection"] = "close"
            return reply

    def _chat_prompt(self, body: ChatBody) -> list[int]:
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise BadRequest("give max_tokens or max_completion_tokens, not both",
                             "max_completion_tokens")
        messages = [{"role": msg.role, "content": msg.text} for msg in body.messages]
        try:
            return self.text.encode_chat(messages)
        except Exception as err:  # a template that refuses these roles or this order
            raise BadRequest(f"the chat template refused the messages: {err}",
                             "messages") from None

    def _requests(self, body: _Sampling, prompts: list[list[int]], chat: bool,
                  base_id: str) -> list[Request]:
        """``n`` router requests per prompt (choice ``p * n + i``, as vLLM numbers them), each
        checked as the router checks it, so a bad one is a 400 before anything is queued."""
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(f"model {body.model!r} does not exist; this server serves "
                             f"{self.model_name!r}", "model", 404, "not_found_error")
        if body.best_of is not None and body.best_of != body.n:
            raise BadRequest(f"best_of ({body.best_of}) must be >= n ({body.n})"
                             if body.best_of < body.n else
                             "best_of > n is not supported by pdlab serve (it returns every "
                             "choice it generates: best_of = n)", "best_of")
        prompt_param = "messages" if chat else "prompt"
        max_param = ("max_completion_tokens" if getattr(body, "max_completion_tokens", None)
                     else "max_tokens")
        if chat:
            if body.top_logprobs is not None and not body.logprobs:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        requests = []
        for p, prompt in enumerate(prompts):
            max_tokens = self._max_tokens(body, prompt, chat, prompt_param, max_param)
            for i in range(body.n):
                try:
                    sampling = SamplingParams(
                        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                        top_k=body.top_k, min_p=body.min_p,
                        seed=None if body.seed is None else body.seed + i,
                        stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos,
                        logprobs=logprobs, min_tokens=body.min_tokens,
                        repetition_penalty=body.repetition_penalty,
                        presence_penalty=body.presence_penalty,
                        frequency_penalty=body.frequency_penalty)
                    request = Request(f"{base_id}-{p * body.n + i}", tuple(prompt), sampling)
                    self.router.validate(request)
                except ValueError as err:
                    raise _refusal(err, prompt_param, max_param) from None
                requests.append(request)
        return requests

    def _max_tokens(self, body: _Sampling, prompt: list[int], chat: bool, prompt_param: str,
                    max_param: str) -> int:
        """``max_tokens``, or OpenAI's default (16; for chat what the context and KV cache
        leave)."""
        if not prompt:
            raise BadRequest("prompt must not be empty (no tokens)", prompt_param)
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if max_tokens is None:
            context = self.router.max_model_len
            room = min([context] + [tokens for role, tokens in self.router.kv_capacity_tokens.items()
                                    if role != "prefill"])  # ... and the KV cache holds
            max_tokens = max(1, room - len(prompt)) if chat else max(1, min(16, context - len(prompt)))
        return max_tokens

    async def _serve(self, http: HTTPRequest, body: _Sampling, prompts: list[list[int]],
                     chat: bool) -> Response:
        base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        requests = self._requests(body, prompts, chat, base_id)
        choices = {r.request_id: _Choice(i, r.request_id, TextStream(
                       self.text, body.stop, body.skip_special_tokens,
                       body.include_stop_str_in_output))
                   for i, r in enumerate(requests)}
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event: StreamEvent) -> None:  # on the router's thread
            if event.kind == FINISH and event.record is not None:
                try:  # a metrics fault must not cost the client its answer
                    self.metrics.observe(event.record)
                except Exception:  # noqa: BLE001
                    _LOG.exception("metrics of request %s not recorded", event.request_id)
            loop.call_soon_threadsafe(events.put_nowait, event)

        for request in requests:
            self.router.submit(request, sink)
        call = _Call(self, base_id, chat, body, sum(map(len, prompts)), choices, events)
        if not body.stream:
            return await call.whole(http)
        refused = await call.refused_before_any_token(http)
        if refused is not None:
            return refused
        return _ClosingStream(call.sse(http), media_type="text/event-stream")

    def unavailable(self, error: str) -> JSONResponse:
        """503 for a request that found no live worker for it (a pool empty while its
        workers restart, or for good); ``Retry-After`` while a restart is under way."""
        reply = error_response(BadRequest(f"service unavailable: {error}", None, 503,
                                          "service_unavailable"))
        if any(w.restarting for w in self.router.workers.values()):
            reply.headers["retry-after"] = str(RETRY_AFTER_S)
        return reply


def _refusal(err: ValueError, prompt_param: str, max_param: str) -> BadRequest:
    """A ValueError of ``SamplingParams``, ``Request`` or ``Router.validate`` as a 400."""
    message = str(err)
    field = getattr(err, "field", None)
    if field is None:
        first = message.split(" ", 1)[0].rstrip(":")
        field = "prompt" if first in ("request", "prompt_token_ids") else first
    param = {"prompt": prompt_param, "max_tokens": max_param}.get(field, field)
    return BadRequest(message, param)


class _ClosingStream(StreamingResponse):
    """Closes its generator as soon as sending stops, so the ``finally`` aborts at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Call:
    """One HTTP request's choices in flight: folds router events into OpenAI responses."""

    def __init__(self, server: OpenAIServer, base_id: str, chat: bool, body: _Sampling,
                 num_prompt_tokens: int, choices: dict[str, _Choice],
                 events: asyncio.Queue) -> None:
        self.server, self.id, self.chat, self.body = server, base_id, chat, body
        self.num_prompt_tokens = num_prompt_tokens
        self.choices = choices
        self.events = events
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._getter: asyncio.Future | None = None
        self._watcher: asyncio.Future | None = None
        self._peeked: StreamEvent | None = None  # taken by refused_before_any_token, not yet used

    @property
    def answered(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())

    def _fold(self, event: StreamEvent) -> tuple[_Choice, str] | None:
        """Apply one event; returns (choice, text delta) when the choice has news to send."""
        choice = self.choices[event.request_id]
        if event.kind == FINISH:
            choice.finished = True
            if choice.finish_reason is None:  # ended by the router, not by its last token
                choice.finish_reason = event.finish_reason
                choice.error = event.error
                choice.unavailable = event.unavailable
                return choice, choice.text.finish()
            return None
        if choice.finish_reason is not None:  # tokens relayed after a stop string matched
            return None
        delta, stopped = choice.text.add(event.token_id)
        if event.logprob is not None:
            choice.entries.append((event.token_id, event.logprob, event.top_logprobs))
        if stopped:
            choice.finish_reason = "stop"
            self.server.router.abort(choice.request_id)  # frees its KV on every worker
        elif event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            delta += choice.text.finish()
        return choice, delta

    def usage(self) -> dict:
        """OpenAI usage: the prompt counted once, the completions of every choice summed
        (tokens up to and including the one that ended each choice)."""
        completion = sum(c.text.num_tokens for c in self.choices.values())
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion}

    def _count(self) -> None:
        metrics = self.server.metrics
        usage = self.usage()
        metrics.prompt_tokens.inc(usage["prompt_tokens"])
        metrics.generation_tokens.inc(usage["completion_tokens"])
        for c in self.choices.values():
            metrics.success.labels(self.server.model_name, c.finish_reason).inc()

    def _failed(self) -> _Choice | None:
        failed = [c for c in self.choices.values() if c.finish_reason == "error"]
        return min(failed, key=lambda c: c.index) if failed else None

    def _error_response(self, choice: _Choice) -> JSONResponse:
        if choice.unavailable:
            return self.server.unavailable(choice.error)
        return error_response(BadRequest(f"generation failed: {choice.error}", None, 500,
                                         "internal_error"))

    async def refused_before_any_token(self, http: HTTPRequest) -> Response | None:
        """Streaming: wait for the first event, so a request refused before its first token
        (no live worker: 503; failed: 500) gets an HTTP error status instead of a stream
        with an error event. None: stream it (the event is kept for ``sse``)."""
        event = await self._next_event(http)
        if event is None:  # the client is gone
            self._abort_unanswered()
            return Response(status_code=499)
        if event.kind == FINISH and event.finish_reason == "error":
            self._fold(event)
            self._abort_unanswered()
            return self._error_response(self.choices[event.request_id])
        self._peeked = event
        return None

    async def _next_event(self, http: HTTPRequest) -> StreamEvent | None:
        """The next router event, or None once the client has disconnected (none is lost)."""
        if self._peeked is not None:
            event, self._peeked = self._peeked, None
            return event
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch(http))
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.events.get())
        done, _ = await asyncio.wait({self._getter, self._watcher},
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._getter in done:
            event, self._getter = self._getter.result(), None
            return event
        return None

    @staticmethod
    async def _watch(http: HTTPRequest) -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    def _abort_unanswered(self) -> None:
        for task in (self._getter, self._watcher):
            if task is not None:
                task.cancel()
        self._getter = self._watcher = None
        for c in self.choices.values():
            if not c.finished:
                self.server.router.abort(c.request_id)

    async def whole(self, http: HTTPRequest) -> Response:
        """A non-streamed answer; a client gone while waiting aborts its requests."""
        try:
            while not self.answered:
                event = await self._next_event(http)
                if event is None:  # the client is gone
                    return Response(status_code=499)
                news = self._fold(event)
                if news is not None:
                    news[0].pieces.append(news[1])
        finally:
            self._abort_unanswered()
        failed = self._failed()
        if failed is not None:
            return self._error_response(failed)
        self._count()
        out = []
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            text = "".join(c.pieces)
            logprobs = self._logprobs(c.entries)
            if self.chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created,
                             "model": self.server.model_name, "choices": out,
                             "usage": self.usage()})

    def _chunk(self, choice: _Choice | None, delta: str, first: bool) -> str:
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage)
        chunk: dict[str, Any] = {"id": self.id, "created": self.created,
                                 "model": self.server.model_name,
                                 "object": "chat.completion.chunk" if self.chat else "text_completion"}
        if choice is None:  # the usage chunk
            chunk.update(choices=[], usage=self.usage())
        else:
            entries, choice.num_sent = choice.entries[choice.num_sent:], len(choice.entries)
            logprobs = self._logprobs(entries, choice.text_offset) if entries else None
            if entries and not self.chat:
                choice.text_offset += sum(len(self._token_text(e[0])) for e in entries)
            if self.chat:
                body: dict[str, Any] = {"index": choice.index,
                                        "delta": ({"role": "assistant", "content": delta} if first
                                                  else {"content": delta}),
                                        "logprobs": logprobs}
            else:
                body = {"index": choice.index, "text": delta, "logprobs": logprobs}
            body["finish_reason"] = choice.finish_reason
            chunk["choices"] = [body]
            if include_usage:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                chunk["usage"] = self.usage() if options.continuous_usage_stats else None
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def _token_text(self, token_id: int) -> str:
        return self.server.text.decode([token_id])

    def _token_bytes(self, token_id: int) -> list[int]:
        if isinstance(self.server.text, ByteText):
            return [token_id] if 0 <= token_id < 256 else []
        return list(self._token_text(token_id).encode("utf-8"))

    def _logprobs(self, entries: list[tuple], text_offset: int = 0) -> dict | None:
        """OpenAI's ``logprobs`` of some completion tokens (None when off): chat's ``{"content"}``
        or completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
        if self._logprobs_off:
            return None
        if self.chat:
            def item(tid: int, lp: float) -> dict:
                return {"token": self._token_text(tid), "logprob": lp,
                        "bytes": self._token_bytes(tid)}
            return {"content": [{**item(tid, lp),
                                 "top_logprobs": [item(t, v) for t, v in top]}
                                for tid, lp, top in entries]}
        tokens = [self._token_text(tid) for tid, _, _ in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [self._top_dict(top) for _, _, top in entries],
                "text_offset": offsets}

    def _top_dict(self, top: tuple) -> dict[str, float]:
        """Completions' ``{text: logprob}``; tokens of equal text keep the most likely's value."""
        out: dict[str, float] = {}
        for token_id, value in top:
            out.setdefault(self._token_text(token_id), value)
        return out

    @property
    def _logprobs_off(self) -> bool:
        return not self.body.logprobs if self.chat else self.body.logprobs is None

    async def sse(self, http: HTTPRequest) -> AsyncIterator[str]:
        """Server-sent events; a client gone (its ``http.disconnect``, or a failed send)
        aborts its requests at once."""
        started: set[int] = set()
        try:
            while not self.answered:
                event = await self._next_event(http)
                if event is None:  # the client is gone
                    return
                news = self._fold(event)
                if news is None:
                    continue
                choice, delta = news
                if choice.finish_reason == "error":
                    error = {"message": f"generation failed: {choice.error}",
                             "type": "internal_error", "param": None, "code": 500}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    break
                yield self._chunk(choice, delta, choice.index not in started)
                started.add(choice.index)
            else:
                self._count()
                if self.body.stream_options and self.body.stream_options.include_usage:
                    yield self._chunk(None, "", False)
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unanswered()


def text_of(loaded_tokenizer: Any) -> ByteText | HFText:
    """``HFText`` over a tokenizer, ``ByteText`` when the model has none (tiny models)."""
    return ByteText() if loaded_tokenizer is None else HFText(loaded_tokenizer)


class ServerThread:
    """uvicorn serving ``app`` on a background thread; ``url`` is ``http://host:port`` once
    started (port 0 picks a free one); ``stop()`` also stops the router loop.

    Raises (from ``start``):
        RuntimeError: the server did not come up within ``timeout_s``."""

    def __init__(self, app: FastAPI, host: str = LOOPBACK, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn", daemon=True)

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        end_s = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > end_s or not self.thread.is_alive():
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def serve_forever(server: OpenAIServer, host: str, port: int) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM stop uvicorn, then the router)."""
    uvicorn.run(server.app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
