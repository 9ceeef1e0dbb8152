"""The HTTP routes of `msinfer serve`: OpenAI's completions, chat, models; health; metrics.

Routes only translate: a request becomes token ids and SamplingParams, is submitted to the
engine loop (`lockstep.EngineLoop`), and the loop's RequestOutputs come back through an
asyncio queue as a JSON response or as server-sent events. Every error is an OpenAI-shaped
`{"error": {...}}` with a 4xx/5xx status; tracebacks stay in the server's log.
"""
import asyncio
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import log
from ..engine.sampling import SamplingParams
from ..errors import MsinferError
from . import protocol as p
from .lockstep import ServerBusy


class ApiError(Exception):
    def __init__(self, status, message, type_="invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers


@dataclasses.dataclass
class ServerConfig:
    model_names: list  # the first is reported back in responses
    max_model_len: int
    api_key: str = None
    max_queue: int = 1024


def _error_response(status, message, type_, param=None, code=None, headers=None):
    body = p.ErrorResponse(error=p.ErrorBody(message=message, type=type_, param=param,
                                             code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def build_app(engine_loop, tokenizer, config, metrics):
    app = FastAPI(title="msinfer", docs_url=None, redoc_url=None, openapi_url=None)
    logger = log.get()

    @app.exception_handler(ApiError)
    async def api_error(request, e):
        metrics.observe_rejected(e.status)
        return _error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e):
        metrics.observe_rejected(400)
        errors = e.errors()
        first = errors[0] if errors else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error')}"
        elif first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {'.'.join(where)}"
        else:
            message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}"
            if "input" in first and first.get("type") != "missing":
                message += f" (got {json.dumps(first['input'], default=str)[:80]})"
        return _error_response(400, message, "invalid_request_error",
                               param=".".join(where) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        return _error_response(e.status_code, str(e.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request, e):
        logger.exception("internal error on %s", request.url.path)
        metrics.observe_rejected(500)
        return _error_response(500, f"internal server error: {type(e).__name__}",
                               "internal_error")

    @app.middleware("http")
    async def check_api_key(request, call_next):
        if config.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {config.api_key}":
                metrics.observe_rejected(401)
                return _error_response(401, "missing or wrong API key: send "
                                       "'Authorization: Bearer <key>'",
                                       "authentication_error", code="invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if engine_loop.ready:
            return {"status": "ok"}
        status = (f"failed: {engine_loop.failure}" if engine_loop.failure
                  else "not ready (warming up or shutting down)")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return p.ModelList(data=[p.ModelCard(id=name, max_model_len=config.max_model_len)
                                 for name in config.model_names])

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        _check(body)
        prompts = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompts.append((prompt, _tokenize(tokenizer.encode, prompt) if prompt else []))
            else:
                prompts.append((None, list(prompt)))
        return await _serve(CompletionsFormat(body, config.model_names[0], tokenizer),
                            prompts, body.max_tokens or 16, body.logprobs, request)

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request):
        _check(body)
        text = _tokenize(tokenizer.apply_chat_template,
                         [m.as_template_message() for m in body.messages])
        ids = _tokenize(tokenizer.encode, text)
        max_tokens = body.token_budget() or max(1, config.max_model_len - len(ids))
        return await _serve(ChatFormat(body, config.model_names[0], tokenizer),
                            [(text, ids)], max_tokens, body.logprobs_count(), request)

    def _check(body):
        if body.model not in config.model_names:
            raise ApiError(404, f"The model `{body.model}` does not exist.",
                           param="model", code="model_not_found")
        unsupported = body.unsupported()
        if unsupported:
            raise ApiError(400, f"{unsupported[0]}: {unsupported[1]}", param=unsupported[0])
        if not engine_loop.ready:
            raise ApiError(503, "the server is not accepting requests: "
                           + (engine_loop.failure or "warming up or shutting down"),
                           "service_unavailable", headers={"Retry-After": "5"})
        depth = engine_loop.queue_depth()
        if depth >= config.max_queue:
            raise ApiError(503, f"{depth} requests are waiting (--max-queue "
                           f"{config.max_queue}); retry later", "service_unavailable",
                           headers={"Retry-After": "1"})

    async def _serve(fmt, prompts, max_tokens, logprobs, request):
        body = fmt.body
        try:
            kwargs = dict(max_tokens=max_tokens, temperature=body.temperature,
                          top_k=body.top_k, top_p=body.top_p, seed=body.seed,
                          stop=body.stop_strings(), stop_token_ids=tuple(body.stop_token_ids),
                          ignore_eos=body.ignore_eos)
            if logprobs is not None:
                kwargs["logprobs"] = logprobs
            params = SamplingParams(**kwargs)
        except (MsinferError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        for text, ids in prompts:
            if not ids:
                raise ApiError(400, "the prompt is empty: give at least one token",
                               param="prompt")
        loop = asyncio.get_running_loop()
        outputs = asyncio.Queue()
        arrival = time.monotonic()
        tracks = []
        for index, (text, ids) in enumerate(prompts):
            request_id = f"{fmt.id}-{index}"

            def sink(out, index=index):
                try:
                    loop.call_soon_threadsafe(outputs.put_nowait, (index, out))
                except RuntimeError:
                    pass  # the event loop is closed: the server is going down
            tracks.append(Track(request_id, ids, params, arrival, metrics))
            try:
                accepted = engine_loop.submit(request_id, ids, params, text, sink)
            except ServerBusy as e:
                _abort(tracks[:-1])
                raise ApiError(503, str(e), "service_unavailable",
                               headers={"Retry-After": "5"}) from None
            try:
                await asyncio.wrap_future(accepted)
            except MsinferError as e:
                _abort(tracks[:-1])
                raise ApiError(400, str(e), param="prompt") from None
            except ServerBusy as e:
                _abort(tracks[:-1])
                raise ApiError(503, str(e), "service_unavailable") from None
            except asyncio.CancelledError:
                _abort(tracks)
                raise
        if body.stream:
            return StreamingResponse(_stream(fmt, tracks, outputs, request),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(fmt, tracks, outputs, request)

    def _abort(tracks):
        for track in tracks:
            if not track.finished:
                engine_loop.abort(track.request_id)

    async def _stream(fmt, tracks, outputs, request):
        # Watch for the client leaving as _collect does: writing into a closed connection does
        # not always fail, and the request would run to its end.
        left = asyncio.ensure_future(_client_left(request))
        try:
            for chunk in fmt.opening_chunks(len(tracks)):
                yield _sse(chunk)
            while not all(t.finished for t in tracks):
                got = asyncio.ensure_future(outputs.get())
                await asyncio.wait({got, left}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return  # the finally aborts
                index, out = got.result()
                if isinstance(out, Exception):
                    yield _sse(p.ErrorResponse(error=p.ErrorBody(
                        message=str(out), type="service_unavailable")))
                    return
                track = tracks[index]
                delta = track.advance(out, tokenizer)
                if delta.text or delta.token_ids or out.finished:
                    yield _sse(fmt.chunk(index, delta, track.finish_reason))
            if fmt.body.include_usage:
                yield _sse(fmt.usage_chunk(_usage(tracks)))
            yield "data: [DONE]\n\n"
        finally:
            left.cancel()
            _abort(tracks)  # the client left mid-stream: free its blocks

    async def _collect(fmt, tracks, outputs, request):
        left = asyncio.ensure_future(_client_left(request))
        try:
            while not all(t.finished for t in tracks):
                got = asyncio.ensure_future(outputs.get())
                await asyncio.wait({got, left}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return Response(status_code=499)  # nobody reads it; the finally aborts
                index, out = got.result()
                if isinstance(out, Exception):
                    raise ApiError(503, str(out), "service_unavailable")
                tracks[index].advance(out, tokenizer)
        finally:
            left.cancel()
            _abort(tracks)
        return fmt.response(tracks, _usage(tracks))

    return app


def _tokenize(step, value):
    """A tokenizer step; its refusals (no tokenizer.json, a template's raise_exception) are
    the request's fault: 400."""
    try:
        return step(value)
    except MsinferError as e:
        raise ApiError(400, str(e)) from None


async def _client_left(request):
    """Returns once the client has closed the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(tracks):
    prompt = sum(len(t.prompt_token_ids) for t in tracks)
    completion = sum(len(t.token_ids) for t in tracks)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion)


def _sse(model):
    return f"data: {model.model_dump_json()}\n\n"


@dataclasses.dataclass
class Delta:
    text: str
    token_ids: list
    logprobs: list  # dicts, one per new token, when asked for


class Track:
    """One engine request seen from its HTTP request: what has been sent, and when."""

    def __init__(self, request_id, prompt_token_ids, params, arrival, metrics):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival = arrival
        self.metrics = metrics
        self.first_token = None
        self.token_ids = []
        self.logprobs = []
        self.text = ""  # final text once finished; what may be sent so far before
        self.sent = 0  # characters of text already streamed
        self.finished = False
        self.finish_reason = None

    def advance(self, out, tokenizer):
        """Take the cumulative output `out`; return what is new and safe to send."""
        now = time.monotonic()
        new_ids = out.token_ids[len(self.token_ids):]
        new_logprobs = (out.logprobs or [])[len(self.logprobs):]
        if new_ids and self.first_token is None:
            self.first_token = now
        self.token_ids = list(out.token_ids)
        self.logprobs = list(out.logprobs or [])
        text = out.text
        if not out.finished:
            text = _safe_prefix(text, self.params.stop)
        self.finished = out.finished
        if out.finished:
            self.finish_reason = out.finish_reason
            self.metrics.observe_request(self.arrival, self.first_token, now,
                                         len(self.token_ids), out.finish_reason)
        delta = text[self.sent:]
        self.text, self.sent = text, max(self.sent, len(text))
        return Delta(delta, new_ids, new_logprobs)


def _safe_prefix(text, stops):
    """The part of unfinished text that will not change: not an incomplete UTF-8 character
    (shown as U+FFFD at the end) nor the start of a stop string that may be cut off."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[:end].endswith(stop[:k]):
                end -= k
                break
    return text[:end]


def _token_text(tokenizer, token_id):
    return tokenizer.decode([token_id])


class CompletionsFormat:
    def __init__(self, body, model_name, tokenizer):
        self.body, self.model, self.tokenizer = body, model_name, tokenizer
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.top_n = body.logprobs

    def _logprobs(self, token_ids, logprobs, offset=0):
        if self.top_n is None:
            return None
        result = p.CompletionLogprobs()
        for token_id, lp in zip(token_ids, logprobs):
            token = _token_text(self.tokenizer, token_id)
            result.text_offset.append(offset)
            offset += len(token)
            result.tokens.append(token)
            result.token_logprobs.append(lp[token_id])
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:self.top_n]
            result.top_logprobs.append({_token_text(self.tokenizer, t): v for t, v in top})
        return result

    def opening_chunks(self, n):
        return []

    def chunk(self, index, delta, finish_reason):
        choice = p.CompletionChoice(index=index, text=delta.text, finish_reason=finish_reason,
                                    logprobs=self._logprobs(delta.token_ids, delta.logprobs))
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                    choices=[choice])

    def usage_chunk(self, usage):
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                    choices=[], usage=usage)

    def response(self, tracks, usage):
        return p.CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            choices=[p.CompletionChoice(index=i, text=t.text, finish_reason=t.finish_reason,
                                        logprobs=self._logprobs(t.token_ids, t.logprobs))
                     for i, t in enumerate(tracks)])


class ChatFormat:
    def __init__(self, body, model_name, tokenizer):
        self.body, self.model, self.tokenizer = body, model_name, tokenizer
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.top_n = body.logprobs_count()

    def _logprobs(self, token_ids, logprobs):
        if self.top_n is None:
            return None
        content = []
        for token_id, lp in zip(token_ids, logprobs):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:self.top_n]
            content.append(p.TokenLogprob(**self._entry(token_id, lp[token_id]),
                                          top_logprobs=[p.TopLogprob(**self._entry(t, v))
                                                        for t, v in top]))
        return p.ChatLogprobs(content=content)

    def _entry(self, token_id, logprob):
        token = _token_text(self.tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def opening_chunks(self, n):
        return [self._chunk([p.ChatStreamChoice(index=i, delta=p.ChatDelta(role="assistant",
                                                                           content=""))])
                for i in range(n)]

    def _chunk(self, choices, usage=None):
        return p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                     choices=choices, usage=usage)

    def chunk(self, index, delta, finish_reason):
        return self._chunk([p.ChatStreamChoice(
            index=index, delta=p.ChatDelta(content=delta.text), finish_reason=finish_reason,
            logprobs=self._logprobs(delta.token_ids, delta.logprobs))])

    def usage_chunk(self, usage):
        return self._chunk([], usage)

    def response(self, tracks, usage):
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            choices=[p.ChatChoice(index=i, message=p.AssistantMessage(content=t.text),
                                  finish_reason=t.finish_reason,
                                  logprobs=self._logprobs(t.token_ids, t.logprobs))
                     for i, t in enumerate(tracks)])
