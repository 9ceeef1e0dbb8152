"""What completions and chat share: submitting prompts to the engine loop and turning its
outputs into one JSON response or a stream of server-sent events.

An endpoint (serving_completion.py, serving_chat.py) makes token ids and SamplingParams of its
request and a format of its response; `Serving.generate` submits every prompt to the engine
loop (`lockstep.EngineLoop`), whose RequestOutputs come back through an asyncio queue, and
follows each engine request with a `RequestStream` until all have finished or the client has
left (then it aborts them). Refusals are `ApiError`s, which the app answers as OpenAI-shaped
errors.

A format has `id` (the response's), `body` (the request), `opening_chunks(n)`,
`chunk(index, delta, finish_reason)`, `usage_chunk(usage)` and `response(streams, usage)`.
"""
import asyncio
import dataclasses
import time

from fastapi.responses import JSONResponse, Response, StreamingResponse

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


# A request the model failed on (finish reason "error": its logits were NaN or inf, e.g. a
# float16 overflow): 500, the server's fault, not the client's (422 would send the client to
# change a valid request in vain); the message says what the operator can do.
MODEL_FAILURE = (500, "internal_error", "non_finite_logits")


class Serving:
    """The engine loop as the endpoints see it: checks that a request may be taken, runs its
    prompts, returns the response or the stream."""

    def __init__(self, engine_loop, tokenizer, config, engine_config, metrics):
        """config: the server's ServerConfig; engine_config: the served engine's
        EngineConfig (its limits bound what a request may ask)."""
        self.engine_loop, self.tokenizer = engine_loop, tokenizer
        self.config, self.engine_config, self.metrics = config, engine_config, metrics

    @property
    def model_name(self):
        """The name responses report."""
        return self.config.model_names[0]

    def check(self, body):
        """Refuse a request for another model, with a field msinfer does not do, or while the
        loop does not take requests or its queue is full. Returns the response headers that
        name the request's ignored fields (unknown ones, logged here), if any."""
        config, engine_loop = self.config, self.engine_loop
        if body.model not in config.model_names:
            raise ApiError(404, f"The model `{body.model}` does not exist.",
                           param="model", code="model_not_found")
        refuse_lone_surrogates(body)
        refused = body.unsupported() or body.out_of_bounds(self.engine_config.limits)
        if refused:
            raise ApiError(400, f"{refused[0]}: {refused[1]}", param=refused[0])
        if not engine_loop.ready:
            raise ApiError(503, "the server is not accepting requests: "
                           + (engine_loop.failure or "warming up or shutting down"),
                           "service_unavailable", headers={"Retry-After": "5"})
        # a request's sequences all wait in the queue at once: they count against --max-queue
        sequences, field = body.sequences()
        if sequences > config.max_queue:
            raise ApiError(400, f"{sequences} sequences in one request (prompts x n, or "
                           f"best_of); the server queues at most {config.max_queue} "
                           f"(--max-queue)", param=field)
        depth = engine_loop.queue_depth()
        if depth + sequences > config.max_queue:
            raise ApiError(503, f"{depth} requests are waiting (--max-queue "
                           f"{config.max_queue}); retry later", "service_unavailable",
                           headers={"Retry-After": "1"})
        return ignored_fields_headers(body.ignored_fields())

    async def generate(self, fmt, prompts, params, request, headers=None):
        """Run `prompts` ((text or None, token ids) each) with `params`; the response of
        `fmt` (with `headers`), streamed when its request asks."""
        for text, ids in prompts:
            if not ids:
                raise ApiError(400, "the prompt is empty: give at least one token",
                               param="prompt")
        loop = asyncio.get_running_loop()
        outputs = asyncio.Queue()
        arrival = time.monotonic()
        streams = []
        # n choices per prompt, choice index prompt * n + j (as OpenAI numbers them); with a
        # seed, choice j draws from seed + j (as vLLM), so the choices differ. With best_of,
        # best_of sequences per prompt run, and the n best return (_best_of)
        per_prompt = fmt.body.sequences_per_prompt()
        choices = [(text, ids, j) for text, ids in prompts for j in range(per_prompt)]
        # every sequence is submitted before any is awaited: the engine loop's next step
        # takes them all (awaiting each in turn took one step per sequence)
        accepted = []
        for index, (text, ids, j) in enumerate(choices):
            choice_params = (params if j == 0 or params.seed is None
                             else dataclasses.replace(params, seed=params.seed + j))

            def sink(out, index=index):
                try:
                    loop.call_soon_threadsafe(outputs.put_nowait, (index, out))
                except RuntimeError:
                    pass  # the event loop is closed: the server is going down
            streams.append(RequestStream(f"{fmt.id}-{index}", ids, choice_params, arrival,
                                         self.metrics, first_choice=j == 0, prompt_text=text))
            try:
                accepted.append(asyncio.wrap_future(self.engine_loop.submit(
                    streams[-1].request_id, ids, choice_params, text, sink)))
            except ServerBusy as e:
                self._abort(streams[:-1])
                raise ApiError(503, str(e), "service_unavailable",
                               headers={"Retry-After": "5"}) from None
        await self._accepted(streams, accepted)
        if fmt.body.stream:
            return StreamingResponse(self._stream(fmt, streams, outputs, request),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **(headers or {})})
        response = await self._collect(fmt, streams, outputs, request)
        if isinstance(response, Response):
            return response
        return JSONResponse(response.model_dump(mode="json"), headers=headers)

    async def _accepted(self, streams, accepted):
        """Wait until the engine loops took every sequence (each stream learns its replica);
        if one was refused, abort the others and answer for the refusal."""
        try:
            results = await asyncio.gather(*accepted, return_exceptions=True)
        except asyncio.CancelledError:
            self._abort(streams)
            raise
        refused = next((r for r in results if isinstance(r, BaseException)), None)
        if refused is None:
            for stream, replica in zip(streams, results):
                stream.replica = replica or 0
            return
        self._abort(streams)
        if isinstance(refused, MsinferError):
            raise ApiError(400, str(refused), param="prompt") from None
        if isinstance(refused, ServerBusy):
            raise ApiError(503, str(refused), "service_unavailable",
                           headers={"Retry-After": "5"}) from None
        raise refused

    def _abort(self, streams):
        for stream in streams:
            if not stream.finished:
                self.engine_loop.abort(stream.request_id)

    async def _stream(self, fmt, streams, outputs, request):
        """The events of a streamed response. However it ends, a client that is still there
        reads `data: [DONE]` last: after the chunks and usage, or after an error event (the
        engine loop failed, or anything here raised)."""
        # Watch for the client leaving as _collect does: writing into a closed connection does
        # not always fail, and the request would run to its end.
        left = asyncio.ensure_future(_client_left(request))
        try:
            # vLLM's continuous_usage_stats: every chunk says the usage so far
            continuous = fmt.body.continuous_usage

            def event(chunk):
                if continuous:
                    chunk.usage = _usage(streams)
                return _sse(chunk)
            for chunk in fmt.opening_chunks(len(streams)):
                yield event(chunk)
            while not all(s.finished for s in streams):
                got = asyncio.ensure_future(outputs.get())
                await asyncio.wait({got, left}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return  # the client left; the finally aborts
                index, out = got.result()
                if isinstance(out, Exception):
                    yield _sse(_error_event(str(out), "service_unavailable"))
                    break
                stream = streams[index]
                delta = stream.advance(out, self.tokenizer)
                if delta.text or delta.token_ids or out.finished:
                    yield event(fmt.chunk(index, delta, stream.finish_reason))
                if out.finish_reason == "error":  # its finish chunk says "error"; then why
                    yield _sse(_error_event(out.error or "the request failed",
                                            *MODEL_FAILURE[1:]))
                    break  # the finally aborts the request's other prompts
            else:
                if fmt.body.include_usage:
                    yield _sse(fmt.usage_chunk(_usage(streams)))
        except Exception as e:  # noqa: BLE001 - reported to the client, logged in full
            log.get().exception("stream %s failed", fmt.id)
            yield _sse(_error_event(f"internal server error: {type(e).__name__}: {e}",
                                    "internal_error"))
        finally:
            left.cancel()
            self._abort(streams)  # the client left or the stream failed: free its blocks
        yield "data: [DONE]\n\n"

    async def _collect(self, fmt, streams, outputs, request):
        left = asyncio.ensure_future(_client_left(request))
        try:
            while not all(s.finished for s in streams):
                got = asyncio.ensure_future(outputs.get())
                await asyncio.wait({got, left}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return Response(status_code=499)  # nobody reads it; the finally aborts
                index, out = got.result()
                if isinstance(out, Exception):
                    raise ApiError(503, str(out), "service_unavailable")
                streams[index].advance(out, self.tokenizer)
                if out.finish_reason == "error":
                    status, type_, code = MODEL_FAILURE
                    raise ApiError(status, out.error or "the request failed", type_, code=code)
        finally:
            left.cancel()
            self._abort(streams)
        # usage counts every sequence run, as OpenAI bills best_of
        return fmt.response(_best_of(streams, fmt.body.sequences_per_prompt(), fmt.body.n),
                            _usage(streams))


def refuse_lone_surrogates(body):
    field = p.lone_surrogate(body)
    if field is not None:
        raise ApiError(400, f"{field}: a string holds a lone UTF-16 surrogate (an escape such "
                            f"as \\ud800 with no pair), which is no character", param=field)


IGNORED_FIELDS_HEADER = "X-Msinfer-Ignored-Fields"


def ignored_fields_headers(names):
    """The header naming a request's ignored fields ({} for none), logged as vLLM logs them."""
    if not names:
        return {}
    # A field name is any JSON string: only printable ASCII goes into the log line and the
    # header, the rest escaped; both are cut at 1 KiB. A header value cannot begin or end
    # with a space: a name's end spaces are escaped too, and the cut value never ends in one.
    value = ",".join(_printable(name) for name in names)[:1024].rstrip(" ")
    log.get().warning("The following fields were present in the request but ignored: %s",
                      value)
    return {IGNORED_FIELDS_HEADER: value}


def _printable(name):
    text = "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in name)
    if text.startswith(" "):
        text = "\\x20" + text[1:]
    if text.endswith(" "):
        text = text[:-1] + "\\x20"
    return text


def sampling_params(body, max_tokens, logprobs, structured=None, prompt_logprobs=None):
    """The SamplingParams of a request (logprobs, prompt_logprobs: top entries per token,
    None for none; structured: the grammar its output follows, server/guided.py); values
    SamplingParams refuses are the request's fault: 400."""
    try:
        kwargs = dict(max_tokens=max_tokens, temperature=body.temperature,
                      top_k=body.top_k, top_p=body.top_p, seed=body.seed,
                      stop=body.stop_strings(), stop_token_ids=tuple(body.stop_token_ids),
                      ignore_eos=body.ignore_eos, min_p=body.min_p or 0.0,
                      presence_penalty=body.presence_penalty or 0.0,
                      frequency_penalty=body.frequency_penalty or 0.0,
                      repetition_penalty=body.repetition_penalty or 1.0,
                      min_tokens=body.min_tokens, logit_bias=body.logit_bias or None,
                      cache_salt=body.cache_salt)
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        if structured is not None:
            kwargs["structured_outputs"] = structured
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = prompt_logprobs
        return SamplingParams(**kwargs)
    except (MsinferError, TypeError) as e:
        raise ApiError(400, str(e), param=getattr(e, "field", None)) from None


def request_check(step, *args):
    """A check of the request's fields (server/guided.py, tool_calls.py); what it refuses is a
    400 naming the field."""
    try:
        return step(*args)
    except MsinferError as e:
        raise ApiError(400, str(e), param=getattr(e, "field", None)) from None


def tokenize(step, value):
    """A tokenizer step; its refusals (no tokenizer.json, a template's raise_exception) are
    the request's fault: 400."""
    try:
        return step(value)
    except MsinferError as e:
        raise ApiError(400, str(e)) from None


def token_text(tokenizer, token_id):
    return tokenizer.decode([token_id])


def token_bytes(tokenizer, token_id):
    """The bytes of one token (a byte-level token may end inside a UTF-8 character, which its
    text shows as U+FFFD); from its text for tokenizers that cannot say."""
    own = getattr(tokenizer, "token_bytes", None)
    return own(token_id) if own is not None else token_text(tokenizer, token_id).encode()


def vllm_prompt_logprobs(tokenizer, prompt_logprobs, top):
    """vLLM's prompt_logprobs of one prompt: null for the first token, then per token
    {token id: PromptLogprob} of the prompt token and the `top` most likely ones, ranked."""
    result = []
    for entry in prompt_logprobs:
        if entry is None:
            result.append(None)
            continue
        prompt_token = next(iter(entry))  # the engine puts the scored token first
        ranked = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        ranks = {t: rank for rank, (t, _) in enumerate(ranked, 1)}
        chosen = dict(ranked)
        chosen.setdefault(prompt_token, entry[prompt_token])
        result.append({str(t): p.PromptLogprob(logprob=v, rank=ranks.get(t),
                                               decoded_token=token_text(tokenizer, t))
                       for t, v in chosen.items()})
    return result


def _best_of(streams, per_prompt, n):
    """Of each prompt's `per_prompt` sequences, the n with the highest cumulative logprob,
    best first (OpenAI's and vLLM's best_of); all of them when per_prompt is n."""
    if per_prompt == n:
        return streams
    chosen = []
    for first in range(0, len(streams), per_prompt):
        group = streams[first:first + per_prompt]
        chosen += sorted(group, key=lambda s: -s.cumulative_logprob())[:n]
    return chosen


async def _client_left(request):
    """Returns once the client has closed the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(streams):
    """Usage as OpenAI counts it: each prompt once however many choices it has."""
    prompt = sum(len(s.prompt_token_ids) for s in streams if s.first_choice)
    completion = sum(len(s.token_ids) for s in streams)
    cached = sum(s.cached_tokens for s in streams if s.first_choice)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


def _sse(model):
    return f"data: {model.model_dump_json()}\n\n"


def _error_event(message, type_, code=None):
    """An error in a stream: OpenAI's error object as one event (the openai client raises
    APIError on it), always followed by `data: [DONE]`."""
    return p.ErrorResponse(error=p.ErrorBody(message=message, type=type_, code=code))


@dataclasses.dataclass
class Delta:
    text: str
    token_ids: list
    logprobs: list  # dicts, one per new token, when asked for
    stream: "RequestStream" = None  # set on a stream's first delta (what echo sends first)


class RequestStream:
    """One engine request seen from its HTTP request: what it has produced, what has been sent
    of it, and when (for the latency metrics)."""

    def __init__(self, request_id, prompt_token_ids, params, arrival, metrics,
                 first_choice=True, prompt_text=None):
        self.request_id = request_id
        self.prompt_text = prompt_text  # None: the prompt came as token ids
        self.first_choice = first_choice  # the first of its prompt's n choices
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival = arrival
        self.metrics = metrics
        self.first_token = self.last_token = None
        self.replica = 0  # the data replica running it
        self.cached_tokens = 0  # prompt tokens the prefix cache held
        self.scheduled_at = None  # when the engine first scheduled it (monotonic)
        self.token_ids = []
        self.logprobs = []
        self.prompt_logprobs = None  # with prompt logprobs asked: from the first output on
        self.opened = False  # has given its first delta
        self.text = ""  # the whole text, once finished
        self.sent = 0  # characters of text already streamed
        self.finished = False
        self.finish_reason = None

    def advance(self, out, tokenizer):
        """Take the cumulative output `out`; return what is new and safe to send. A step
        costs what is new only: `out`'s lists are the engine's read-only views (Prefix), kept
        as they are, and only the text since what was sent is read."""
        new_ids = out.token_ids[len(self.token_ids):]
        logprobs = out.logprobs if out.logprobs is not None else []
        new_logprobs = logprobs[len(self.logprobs):]
        self._observe_tokens(len(new_ids))
        first, self.opened = not self.opened, True
        self.token_ids, self.logprobs = out.token_ids, logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.cached_tokens = out.cached_tokens
        self.scheduled_at = getattr(out, "scheduled_at", None) or self.scheduled_at
        text = out.text
        end = len(text) if out.finished else _safe_end(text, self.sent, self.params.stop)
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        if out.finished:
            self._finish(out)
        return Delta(delta, new_ids, new_logprobs, self if first else None)

    def _observe_tokens(self, count):
        now = time.monotonic()
        if count:
            if self.first_token is None:
                self.first_token = now
                self.metrics.observe_first_token(now - self.arrival, self.replica)
            else:
                self.metrics.observe_token_gap((now - self.last_token) / count, self.replica)
            self.last_token = now

    def _finish(self, out):
        self.finished, self.finish_reason, self.text = True, out.finish_reason, out.text
        self.metrics.observe_request(self.arrival, self.first_token, time.monotonic(),
                                     len(self.token_ids), out.finish_reason,
                                     prompt_tokens=len(self.prompt_token_ids),
                                     max_tokens=self.params.max_tokens,
                                     replica=self.replica, scheduled=self.scheduled_at)

    def cumulative_logprob(self):
        """The sum of the generated tokens' logprobs (they must have been asked for)."""
        return sum(lp[t] for t, lp in zip(self.token_ids, self.logprobs))


def _safe_end(text, sent, stops):
    """Where the part of unfinished `text` that will not change ends: before an incomplete
    UTF-8 character (shown as U+FFFD at the end) and the start of a stop string that may be
    cut off. Reads only what came after the first `sent` characters (those were safe), from
    a stop string's length back."""
    begin = max(sent - max(map(len, stops), default=1) + 1, 0)
    window = text[begin:]
    end = len(window)
    while end and window[end - 1] == "\ufffd":
        end -= 1
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if window.endswith(stop[:k], 0, end):
                end -= k
                break
    return begin + end
