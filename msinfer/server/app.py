"""The HTTP routes of `msinfer serve`: OpenAI's completions, chat, models; vLLM's tokenize,
detokenize, tokenizer_info and version; health; metrics.

Routes only route: completions and chat go to their serving classes (serving_completion.py,
serving_chat.py, over the shared serving.py), which turn a request into token ids and
SamplingParams, run it on the engine loop and return a JSON response or server-sent events.
Every error is an OpenAI-shaped `{"error": {...}}` with a 4xx/5xx status; tracebacks stay in
the server's log. /v1 and the tokenizer endpoints ask for the API key when the server has one.
"""
import json
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__, log
from . import protocol as p
from .responses import add_responses_routes
from .routes_fleet import add_fleet_routes
from .serving import ApiError, Serving
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_tokenize import ServingTokenize, openapi_body

# Paths behind the API key (when the server has one): the OpenAI API and what reads the
# tokenizer (a chat template may be private); /health, /metrics and /version stay open.
_KEYED_PATHS = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")


def build_app(engine_loop, tokenizer, config, engine_config, metrics):
    """The FastAPI app over `engine_loop` (a lockstep.EngineLoop or a replicas.Router);
    config: the server's ServerConfig; engine_config: the served engine's EngineConfig."""
    # /openapi.json as vLLM serves it (what clients and API fuzzers read); no docs pages
    app = FastAPI(title="msinfer", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    serving = Serving(engine_loop, tokenizer, config, engine_config, metrics)
    completion, chat = ServingCompletion(serving), ServingChat(serving)
    _add_error_handlers(app, metrics)
    _add_api_key_check(app, config, metrics)
    # Added last, so the outermost: a body beyond the limit is refused before anything reads it.
    app.add_middleware(BodyLimit, limit=config.max_request_bytes, metrics=metrics)

    @app.get("/health")
    async def health():
        if engine_loop.ready:
            return {"status": "ok"}
        status = (f"failed: {engine_loop.failure}" if engine_loop.failure
                  else f"not ready: {engine_loop.not_ready_reason}")
        return JSONResponse({"status": status}, status_code=503)

    add_fleet_routes(app, serving, health)
    add_responses_routes(app, serving, chat)
    _add_info_routes(app, config, engine_config, metrics)
    _add_tokenizer_routes(app, ServingTokenize(serving))

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        return await completion.create(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    return app


def _add_info_routes(app, config, engine_config, metrics):
    """/metrics, /v1/models, /version."""
    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return p.ModelList(data=[p.ModelCard(id=name, root=engine_config.model,
                                             max_model_len=engine_config.max_model_len)
                                 for name in config.model_names])

    @app.get("/version")
    async def version():
        return p.VersionResponse(version=__version__)


def _add_tokenizer_routes(app, tokens):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (tokens: a ServingTokenize)."""
    @app.post("/tokenize", openapi_extra=openapi_body(p.TokenizeCompletionRequest,
                                                      p.TokenizeChatRequest))
    async def tokenize(request: Request):
        body, headers = await tokens.tokenize(request)
        return JSONResponse(body.model_dump(mode="json"), headers=headers)

    @app.post("/detokenize", openapi_extra=openapi_body(p.DetokenizeRequest))
    async def detokenize(request: Request):
        body, headers = await tokens.detokenize(request)
        return JSONResponse(body.model_dump(mode="json"), headers=headers)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokens.tokenizer_info()


def _error_response(status, message, type_, param=None, code=None, headers=None):
    body = p.ErrorResponse(error=p.ErrorBody(message=message, type=type_, param=param,
                                             code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _add_error_handlers(app, metrics):
    logger = log.get()

    @app.exception_handler(ApiError)
    async def api_error(request, e):
        metrics.observe_rejected(e.status)
        return _error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e):
        metrics.observe_rejected(400)
        message, param = _validation_message(e.errors())
        return _error_response(400, message, "invalid_request_error", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        return _error_response(e.status_code, str(e.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request, e):
        logger.exception("internal error on %s", request.url.path)
        metrics.observe_rejected(500)
        return _error_response(500, f"internal server error: {type(e).__name__}",
                               "internal_error")


def _validation_message(errors):
    """(message, param) for pydantic's first complaint about a request body, worded as
    OpenAI words its 400s."""
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
    return message, ".".join(where) or None


def _add_api_key_check(app, config, metrics):
    @app.middleware("http")
    async def check_api_key(request, call_next):
        if config.api_key and request.url.path.startswith(_KEYED_PATHS):
            # compared in constant time: how long a refusal takes tells nothing of the key
            if not secrets.compare_digest(_bytes(request.headers.get("authorization", "")),
                                          _bytes(f"Bearer {config.api_key}")):
                metrics.observe_rejected(401)
                return _error_response(401, "missing or wrong API key: send "
                                       "'Authorization: Bearer <key>'",
                                       "authentication_error", code="invalid_api_key")
        return await call_next(request)


class BodyLimit:
    """413 with an OpenAI error for a request body beyond `limit` bytes, before a route (or
    pydantic) sees any of it: a Content-Length beyond the limit is refused unread; a chunked
    body is read here while it stays within the limit, then handed on."""

    def __init__(self, app, limit, metrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.limit:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = 0  # the server refuses a malformed Content-Length itself
            if size > self.limit:
                return await self._refuse(scope, receive, send, f"{size} bytes")
            return await self.app(scope, receive, send)
        if headers.get(b"transfer-encoding") is None:
            return await self.app(scope, receive, send)  # no body
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                parts = None
                replay = [message]
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send, f"more than {self.limit} bytes")
            if not message.get("more_body", False):
                replay = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]
                break

        async def replayed():
            return replay.pop() if replay else await receive()
        return await self.app(scope, replayed, send)

    async def _refuse(self, scope, receive, send, size):
        self.metrics.observe_rejected(413)
        response = _error_response(
            413, f"the request body of {size} exceeds the server's limit of {self.limit} "
                 f"bytes (--max-request-bytes)", "invalid_request_error",
            code="request_too_large")
        await response(scope, receive, send)


def _bytes(text):
    # compare_digest takes only ASCII str; as UTF-8 bytes, any two texts compare (equal iff
    # the texts are)
    return text.encode("utf-8", "surrogatepass")
