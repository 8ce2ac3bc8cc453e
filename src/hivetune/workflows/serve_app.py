"""The HTTP side of `hivetune serve`: an OpenAI-compatible FastAPI app over one ``Engine`` at a time.

    GET  /health                 {"status": "ok", "model": ID}                  (no key needed)
    GET  /v1/models              the model id served now (a registry's version id)
    POST /v1/chat/completions    OpenAI chat completion; "stream": true answers in SSE chunks
    POST /v1/feedback            {"id": EXCHANGE_ID, "rating": 1 | -1, "correction": TEXT | null}

A chat completion's "id" is the exchange id under which the exchange is appended to the
interaction log, so a client posts feedback with it. A streamed exchange is written when the stream
ends, or when the client goes away mid-stream: then with the text sent so far and
``finish_reason: "disconnected"``. Errors are JSON bodies of OpenAI's shape
``{"error": {"message", "type", "code"}}``: 401 without the shared key, 400 for a body that is not
JSON or not a valid request, 413 for a body over MAX_BODY_BYTES (refused from its Content-Length,
or while it is read, never read whole), 503 when too many requests wait.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from hivetune.data.interaction_log import new_exchange_id
from hivetune.workflows.serve_engine import Engine, Job, Params, RequestError

MAX_BODY_BYTES = 10 * 2**20
EXCHANGE_ID = re.compile(r"^ex-[0-9a-f]{32}$")


class ServerState:
    """The engine serving now (swapped whole by the registry watcher), the log and the limits."""

    def __init__(self, engine: Engine, log, max_new_tokens: int):
        self.engine, self.log, self.max_new_tokens = engine, log, max_new_tokens
        self.since = int(time.time())

    def swap(self, engine: Engine) -> None:
        """New requests go to `engine`; the old one finishes the requests it holds, then unloads."""
        old, self.engine, self.since = self.engine, engine, int(time.time())
        old.retire()


# ------------------------------------------------------------------------------ request bodies


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) else \
            "\n".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields that do not apply (user, ...)
    model: str | None = None  # the server serves one model, whatever the request names
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def params(self, max_new_tokens: int) -> Params:
        """Sampling parameters; max_tokens at most the server's --max-new-tokens; temperature 0 (greedy)
        unless asked."""
        asked = self.max_completion_tokens or self.max_tokens or max_new_tokens
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Params(max_tokens=min(asked, max_new_tokens), temperature=self.temperature or 0.0,
                      top_p=self.top_p if self.top_p is not None else 0.95, stop=stop, seed=self.seed)


def error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "code": code}}


def json_error(status: int, message: str, code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


async def read_json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPException(400, f"the body is not JSON ({e})") from None


def parse(model: type[BaseModel], body) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise HTTPException(400, f"{where}: {first['msg']}") from None


def sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ------------------------------------------------------------------------------ exchanges


def usage(job: Job) -> dict:
    c = job.counts
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def record(state: ServerState, job: Job, exchange_id: str, answer: str, stream: bool) -> None:
    first = round(job.first_piece_s, 4) if job.first_piece_s is not None else None
    state.log.exchange(job.model, job.messages, answer, time.perf_counter() - job.started, job.counts.prompt_tokens,
                       job.counts.completion_tokens, exchange_id=exchange_id,
                       finish_reason=job.counts.finish_reason, stream=stream, first_token_s=first)


async def submit(state: ServerState, job: Job) -> None:
    try:
        while not state.engine.submit(job):  # retired between reading state.engine and submit: take the new one
            await asyncio.sleep(0)
    except RequestError as e:
        raise HTTPException(e.status, str(e)) from None


async def answer_whole(state: ServerState, job: Job, exchange_id: str) -> dict:
    pieces, done = [], False
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                pieces.append(value)
            elif kind == "error":
                done = True
                raise HTTPException(value.status, str(value))
            else:
                done = True
                break
    finally:
        if not done:  # the request was cancelled: free the engine
            job.cancelled.set()
    answer = "".join(pieces)
    record(state, job, exchange_id, answer, stream=False)
    return {"id": exchange_id, "object": "chat.completion", "created": int(time.time()), "model": job.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": None,
                         "finish_reason": job.counts.finish_reason}],
            "usage": usage(job)}


async def answer_stream(state: ServerState, job: Job, exchange_id: str, include_usage: bool):
    """SSE chunks of OpenAI's chat.completion.chunk shape, then ``data: [DONE]``. A piece counts as sent
    once the server asks for the next chunk (it went to the transport)."""
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None) -> str:
        return sse({"id": exchange_id, "object": "chat.completion.chunk", "created": created, "model": job.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    sent: list[str] = []
    finish = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        while finish is None:
            kind, value = await job.events.get()
            if kind == "text":
                yield chunk({"content": value})
                sent.append(value)
            elif kind == "end":
                finish = job.counts.finish_reason
                yield chunk({}, finish)
                if include_usage:
                    yield sse({"id": exchange_id, "object": "chat.completion.chunk", "created": created,
                               "model": job.model, "choices": [], "usage": usage(job)})
                yield "data: [DONE]\n\n"
            else:
                finish = "error"
                yield sse(error_body(value.status, str(value)))
                yield "data: [DONE]\n\n"
    finally:
        if finish != "error":
            if finish is None:  # the client went away mid-stream
                job.cancelled.set()
                job.counts.finish_reason = "disconnected"
            record(state, job, exchange_id, "".join(sent), stream=True)


class ExchangeStream(StreamingResponse):
    """A StreamingResponse that always closes its generator, so a stream cut by the client is recorded
    at once rather than when the generator is collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


# ------------------------------------------------------------------------------ the app


def create_app(state: ServerState, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES):
    app = FastAPI(title="hivetune serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return json_error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return json_error(400, str(exc.errors()[:1]))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        return json_error(500, f"internal error ({type(exc).__name__})")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": state.engine.model_id}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.engine.model_id, "object": "model", "created": state.since,
                                            "owned_by": "hivetune"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatRequest, await read_json(request))
        job = Job([m.as_dict() for m in req.messages], req.params(state.max_new_tokens), asyncio.get_running_loop())
        await submit(state, job)
        exchange_id = new_exchange_id()
        if not req.stream:
            return await answer_whole(state, job, exchange_id)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return ExchangeStream(answer_stream(state, job, exchange_id, include_usage), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict):
            raise HTTPException(400, "the body must be a JSON object {id, rating, correction}")
        exchange_id, rating, correction = body.get("id"), body.get("rating"), body.get("correction")
        if not isinstance(exchange_id, str) or not EXCHANGE_ID.match(exchange_id):
            raise HTTPException(400, "id: the exchange id a chat completion returned (ex-<32 hex digits>)")
        if type(rating) is not int or rating not in (1, -1):
            raise HTTPException(400, f"rating: 1 or -1, got {rating!r}")
        if correction is not None and not isinstance(correction, str):
            raise HTTPException(400, "correction: a string or null")
        state.log.feedback(exchange_id, rating, correction)
        return {"id": exchange_id, "recorded": True}

    return Guard(app, api_key, max_body_bytes)


class Guard:
    """ASGI middleware in front of the app: the shared key (every path but /health), then the body
    size: a Content-Length over the limit is refused before a byte is read, a body without one
    (chunked) as soon as what was read passes the limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] != "/health":
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = json_error(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                                      "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            status = 400 if not length.isdigit() else 413
            message = (f"Content-Length: not a number ({length.decode('latin-1')!r})" if status == 400 else
                       f"the body is {int(length)} bytes; the most this server reads is {self.max_body_bytes}")
            return await json_error(status, message)(scope, receive, send)
        read = 0

        async def limited_receive():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body_bytes:
                    raise HTTPException(413, f"the body is over {self.max_body_bytes} bytes, the most this server "
                                             f"reads")
            return message

        await self.app(scope, limited_receive, send)
