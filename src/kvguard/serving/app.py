"""``kvguard serve``: the OpenAI-compatible HTTP application (Starlette) over an :class:`~kvguard.serving.engine.Engine`.

    kvguard serve --model smollm2-135m --profile P [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent
events), ``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` (Prometheus text format) and
``GET /v1/kvguard/status`` (per-layer precision now, rollback level, trigger rate, KV bytes against FP16).
The handlers are module-level functions that find the engine in ``request.app.state.engine``.

Logs: one JSON line per request and one per compensation event, on stderr (or ``--log-file``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import signal
import sys
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvguard.control.decoding import FinishReason
from kvguard.serving.engine import Engine, Job
from kvguard.serving.messages import Done, Failed, TextDelta
from kvguard.serving.settings import ServeConfig
from kvguard.serving.status_page import status_page
from kvguard.serving.protocol import MAX_BODY_BYTES, RequestError, parse_json

COMPLETIONS, CHAT = "completions", "chat.completions"
_ENDPOINTS = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


def _error(err: RequestError) -> Response:
    headers = {"Retry-After": "1"} if err.status == 429 else None
    # json.dumps' ASCII escapes: a message may quote a lone surrogate, which has no UTF-8 encoding.
    return Response(json.dumps(err.body()), status_code=err.status, headers=headers, media_type="application/json")


class BearerAuth:
    """Bearer-key check on every route but /healthz and / (pure ASGI: streaming passes through untouched)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.api_key is not None and scope["path"] not in ("/healthz", "/"):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if given != f"Bearer {self.api_key}":
                what = "no API key was sent" if not given else "the API key is wrong"
                if not given and scope.get("query_string"):
                    what += " (a key in the query string is not read: URLs end up in logs)"
                response = _error(RequestError(401, f"{what}: send 'Authorization: Bearer <key>'",
                                               kind="authentication_error", code="invalid_api_key"))
                # Counted like every other answer: a client with a bad key shows in kvguard_requests_total.
                scope["app"].state.engine.metrics.requests.labels(_ENDPOINTS.get(scope["path"], scope["path"]),
                                                                  "401").inc()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _too_large(size: str) -> RequestError:
    return RequestError(413, f"the request body is {size}; at most {MAX_BODY_BYTES} bytes are accepted")


async def _read_body(request: Request):
    """The request's JSON body, read no further than :data:`MAX_BODY_BYTES`: a chunked body has no
    Content-Length to refuse up front, so the limit applies while reading (what follows is never stored)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise _too_large(f"{size} bytes")
    raw = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > MAX_BODY_BYTES:
                raise _too_large(f"over {MAX_BODY_BYTES} bytes (chunked)")

    timeout = request.app.state.engine.cfg.read_timeout
    try:
        # A client that trickles its body holds a connection, never a place in the batch (admission follows the
        # body), and not even the connection past the deadline.
        await asyncio.wait_for(read(), timeout)
    except ClientDisconnect:
        raise RequestError(499, "the client disconnected before sending the whole body") from None
    except asyncio.TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {timeout:g} s", code="timeout") from None
    return parse_json(bytes(raw))


def _finish(engine: Engine, job: Job, endpoint: str, status: str, done: Done | None, completion_tokens: int = 0) -> None:
    """Count and log one finished request."""
    r, m = job.request, engine.metrics
    now = time.time()
    m.requests.labels(endpoint, status).inc()
    m.latency.labels(endpoint).observe(now - job.arrived)
    m.prompt.inc(len(r.prompt_ids))
    m.generated.inc(completion_tokens)
    engine.totals["requests"] += 1
    engine.totals["generated_tokens"] += completion_tokens
    engine.totals["prompt_tokens"] += len(r.prompt_ids)
    record = {"event": "request", "request": job.id, "endpoint": endpoint, "status": status,
              "stream": r.stream, "prompt_tokens": len(r.prompt_ids), "completion_tokens": completion_tokens,
              "seconds": round(now - job.arrived, 4)}
    if done is not None and done.first_token_at:
        ttft = done.first_token_at - job.arrived
        m.ttft.observe(ttft)
        record["ttft_s"] = round(ttft, 4)
        decode = done.finished_at - done.first_token_at
        if completion_tokens > 1 and decode > 0:
            m.throughput.set((completion_tokens - 1) / decode)
            record["tokens_per_s"] = round((completion_tokens - 1) / decode, 2)
    summary = done.summary if done is not None else None
    if summary:
        record.update(finish_reason=done.finish_reason.value, kv_bytes=summary["kv_bytes"],
                      kv_bytes_fp16=summary["kv_bytes_fp16"], memory_saved=round(summary["memory_saved"], 4),
                      memory=summary["memory"],
                      trigger_rate=round(summary["trigger_rate"], 4), max_level=summary["max_level"],
                      actions=summary["actions"], recomputed_positions=summary["recomputed_positions"])
    engine.log(record)


def _usage(job: Job, completion_tokens: int) -> dict:
    p = len(job.request.prompt_ids)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def _kvguard_block(summary: dict | None) -> dict | None:
    if not summary:
        return None
    return {k: summary[k] for k in ("kv_bytes", "kv_bytes_fp16", "memory_saved", "memory", "trigger_rate",
                                    "max_level", "recomputed_positions", "actions")}


async def _generate(request: Request, endpoint: str):
    engine: Engine = request.app.state.engine
    try:
        body = await _read_body(request)
        r = engine.parser.parse(endpoint, body)
        job = engine.admit(r, asyncio.get_running_loop())
    except RequestError as err:
        return _refuse(engine, endpoint, err)
    except Exception as err:  # noqa: BLE001 - a request validation did not foresee: still counted, logged, OpenAI's body
        what = " ".join(f"{type(err).__name__}: {err}".split())
        return _refuse(engine, endpoint, RequestError(500, f"internal error reading the request: {what}",
                                                      kind="server_error"))
    if r.stream:
        return StreamingResponse(_stream(engine, job, endpoint), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(engine, request, job, endpoint)


def _refuse(engine: Engine, endpoint: str, err: RequestError) -> Response:
    """Count, log and answer a request refused before it reached a worker."""
    engine.metrics.requests.labels(endpoint, str(err.status)).inc()
    engine.log({"event": "request", "endpoint": endpoint, "status": err.status, "error": err.message})
    return _error(err)


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Set ``job``'s cancel flag the moment its client goes away; the worker checks the flag at every token."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()


async def _complete(engine: Engine, request: Request, job: Job, endpoint: str):
    """A non-streamed completion: collect the text, answer once."""
    text: list[str] = []
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    try:
        while True:
            match await job.queue.get():
                case TextDelta(delta):
                    text.append(delta)
                case Done() as done:
                    break
                case Failed(message):
                    _finish(engine, job, endpoint, "500", None)
                    return _error(RequestError(500, message, kind="server_error"))
    except asyncio.CancelledError:
        job.cancelled.set()
        raise
    finally:
        watcher.cancel()
    n = done.completion_tokens
    if done.finish_reason is FinishReason.CANCELLED:
        _finish(engine, job, endpoint, "cancelled", done, n)
        return Response(status_code=499)  # nginx's "client closed request": nobody is left to read it
    _finish(engine, job, endpoint, "200", done, n)
    chat = endpoint == CHAT
    content = "".join(text)
    reason = done.finish_reason.value
    choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
               "finish_reason": reason} if chat else
              {"index": 0, "text": content, "logprobs": None, "finish_reason": reason})
    return JSONResponse({"id": _response_id(job, chat), "object": "chat.completion" if chat else "text_completion",
                         "created": int(job.arrived), "model": engine.model_name, "choices": [choice],
                         "usage": _usage(job, n), "kvguard": _kvguard_block(done.summary)})


def _response_id(job: Job, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + job.id


def _chunk(engine: Engine, job: Job, chat: bool, delta: str | None, finish_reason=None, *, role: bool = False,
           usage: dict | None = None) -> str:
    """One server-sent event of a streamed completion."""
    body = {"id": _response_id(job, chat), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(job.arrived), "model": engine.model_name}
    if usage is not None:
        body.update(choices=[], usage=usage)
    elif chat:
        d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
        body["choices"] = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}]
    else:
        body["choices"] = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}]
    return f"data: {json.dumps(body)}\n\n"


async def _stream(engine: Engine, job: Job, endpoint: str):
    chat = endpoint == CHAT
    status, done = "cancelled", None
    try:
        if chat:
            yield _chunk(engine, job, chat, None, role=True)
        while True:
            match await job.queue.get():
                case TextDelta(delta):
                    yield _chunk(engine, job, chat, delta)
                case Done() as done:
                    break
                case Failed(message):
                    status = "500"
                    yield f"data: {json.dumps(RequestError(500, message, kind='server_error').body())}\n\n"
                    return
        if done.finish_reason is FinishReason.CANCELLED:
            return
        status = "200"
        yield _chunk(engine, job, chat, None, done.finish_reason.value)
        if job.request.include_usage:
            yield _chunk(engine, job, chat, None, usage=_usage(job, done.completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        if status == "cancelled":
            job.cancelled.set()  # the client went away: the worker stops at its next token
        _finish(engine, job, endpoint, status, done, done.completion_tokens if done is not None else job.generated)


async def completions(request: Request):
    return await _generate(request, COMPLETIONS)


async def chat_completions(request: Request):
    return await _generate(request, CHAT)


async def list_models(request: Request):
    engine: Engine = request.app.state.engine
    return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                     "created": int(engine.started), "owned_by": "kvguard"}]})


async def healthz(request: Request):
    return JSONResponse({"status": "ok", "model": request.app.state.engine.model_name})


async def metrics(request: Request):
    return Response(generate_latest(request.app.state.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def status(request: Request):
    return JSONResponse(request.app.state.engine.status())


async def not_found(request: Request, exc):
    return _error(RequestError(404, f"no route {request.method} {request.url.path}", code="not_found"))


async def bad_method(request: Request, exc):
    return _error(RequestError(405, f"{request.method} is not allowed on {request.url.path}"))


ROUTES = [
    Route("/", status_page, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/kvguard/status", status, methods=["GET"]),
]


def build_app(engine: Engine) -> Starlette:
    """The Starlette application serving ``engine``."""
    app = Starlette(routes=ROUTES, middleware=[Middleware(BearerAuth, api_key=engine.cfg.api_key)],
                    exception_handlers={404: not_found, 405: bad_method})
    app.state.engine = engine
    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(cfg: ServeConfig) -> None:
    """Load the model and profile, then serve until interrupted."""
    import uvicorn

    try:  # before the model loads: a log that cannot be written is known at once
        log = open(cfg.log_file, "a", buffering=1) if cfg.log_file else sys.stderr
    except OSError as err:
        raise ValueError(f"--log-file {cfg.log_file}: cannot be written ({err.strerror})") from None
    engine = Engine(cfg, log=log, start=False)
    if not is_loopback(cfg.host):
        print(f"[kvguard serve] warning: listening on {cfg.host}, not loopback"
              + ("" if cfg.api_key else " and without --api-key: anyone who can reach it can use it"),
              file=sys.stderr, flush=True)
    print(f"[kvguard serve] {engine.model_name} with profile {cfg.profile}, plan {cfg.plan}"
          f"{' under the feedback loop' if cfg.loop else ''}; up to {cfg.max_batch} requests per forward, "
          f"{cfg.step_tokens} tokens a step, KV budget {engine.kv_budget / 2**20:.0f} MiB, queue {cfg.max_queue}, "
          f"{engine.torch_threads} torch threads; http://{cfg.host}:{cfg.port}/v1", file=sys.stderr, flush=True)
    # timeout_keep_alive: an idle connection is closed after that many seconds.
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=5))
    # HTTP on a thread of its own, the model on this one, which loaded it: every torch op on one thread, one
    # OpenMP team (Scheduler.run says what a second costs).
    http = threading.Thread(target=server.run, name="kvguard-http", daemon=True)
    stop = lambda *_: engine.scheduler.stop()  # noqa: E731 - Ctrl-C and SIGTERM end the loop, then HTTP
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        engine.scheduler.run(keep_going=http.is_alive)
    finally:
        server.should_exit = True
        http.join(timeout=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if cfg.log_file:
            log.close()
    if not server.started:
        raise ValueError(f"kvguard serve could not listen on {cfg.host}:{cfg.port} (see the error above)")
