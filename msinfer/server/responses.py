"""POST /v1/responses: OpenAI's Responses API (the default of agent frameworks) over the chat
machinery: text, streamed events, function tools, and `previous_response_id` within this
server's memory. GET /v1/responses/{id} returns a stored response.

A request becomes a ChatCompletionRequest (input items as messages, `instructions` as the
system message, flat function tools as chat tools, max_output_tokens as max_tokens), runs as
a chat completion (serving_chat.py: template, tool-call parsing, reasoning parser), and its
answer is turned into output items: a `message` with `output_text`, `function_call`s, a
`reasoning` item with a reasoning parser. Streamed, the chat chunks become Responses events
(response.created, output_item.added, output_text.delta, function_call_arguments.delta, ...
response.completed). A stored response (`store`, default true) keeps its conversation, so a
later request naming it as `previous_response_id` continues it; the memory holds the last
`MEMORY` responses of this process (not shared between replicas or restarts).
"""
import collections
import json
import threading
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import protocol as p
from .responses_format import ResponsesFormat
from .serving import ApiError, ignored_fields_headers

MEMORY = 1024  # stored responses kept (least recently used go first)
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None
    text: Optional[dict[str, Any]] = None  # {"format": {"type": "json_schema", ...}}
    reasoning: Optional[dict[str, Any]] = None  # effort: the chat template decides
    user: Optional[str] = None


class ResponseMemory:
    """Stored responses: id -> (response body, the conversation after it)."""

    def __init__(self, size=MEMORY):
        self.size, self._lock = size, threading.Lock()
        self._entries = collections.OrderedDict()

    def put(self, response_id, body, conversation):
        with self._lock:
            self._entries[response_id] = (body, conversation)
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def get(self, response_id):
        with self._lock:
            return self._entries.get(response_id)


def _text_of(content, where):
    if isinstance(content, str) or content is None:
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in _TEXT_PARTS:
            raise ApiError(400, f"{where}.content.{j}: type {part.get('type')!r}: msinfer "
                                f"takes text parts only", param="input")
        texts.append(part.get("text", ""))
    return "".join(texts)


def input_messages(items):
    """Chat messages of a Responses `input` (a string, or message and function-call items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"),
                             "content": _text_of(item.get("content"), f"input.{i}")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant":  # parallel calls: one turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else json.dumps(output)})
        elif kind != "reasoning":  # a model's reasoning sent back is not prompt text
            raise ApiError(400, f"input.{i}: item type {kind!r}: msinfer takes message, "
                                f"function_call and function_call_output items", param="input")
    return messages


def chat_tools(tools, tool_choice):
    """The chat form of Responses' flat function tools and tool_choice."""
    converted = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise ApiError(400, f"tools.{i}: type {tool.get('type')!r}: msinfer runs function "
                                f"tools only", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        converted.append({"type": "function", "function": function})
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return converted or None, tool_choice


def chat_request(body, history):
    """The ChatCompletionRequest that runs `body` after `history` (stored messages)."""
    messages = list(history) + input_messages(body.input)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    tools, tool_choice = chat_tools(body.tools, body.tool_choice)
    fields = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
              "tools": tools, "tool_choice": tool_choice,
              "parallel_tool_calls": body.parallel_tool_calls, "stream": body.stream,
              "stream_options": {"include_usage": True} if body.stream else None}
    if body.temperature is not None:
        fields["temperature"] = body.temperature
    if body.top_p is not None:
        fields["top_p"] = body.top_p
    text_format = (body.text or {}).get("format") or {}
    if text_format.get("type") == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            k: v for k, v in text_format.items() if k != "type"}}
    elif text_format.get("type") == "json_object":
        fields["response_format"] = {"type": "json_object"}
    try:
        return p.ChatCompletionRequest(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=where.split(".")[0]) from None


class ServingResponses:
    def __init__(self, serving, chat):
        self.serving, self.chat = serving, chat
        self.memory = ResponseMemory()

    async def create(self, body, request):
        history = []
        if body.previous_response_id is not None:
            stored = self.memory.get(body.previous_response_id)
            if stored is None:
                raise ApiError(400, f"Previous response with id '{body.previous_response_id}' "
                                    f"not found.", param="previous_response_id",
                               code="previous_response_not_found")
            history = stored[1]
        chat_body = chat_request(body, history)
        headers = self.serving.check(chat_body)
        extras = [name for name in (body.model_extra or {})]
        headers.update(ignored_fields_headers(extras) if extras else {})
        chat_fmt, prompt, params = self.chat.prepare(chat_body)
        fmt = ResponsesFormat(body, chat_body, chat_fmt, history, self.memory)
        response = await self.serving.generate(fmt, [prompt], params, request, headers)
        if isinstance(response, StreamingResponse):
            response.body_iterator = _events_only(response.body_iterator)
        return response

    def retrieve(self, response_id):
        stored = self.memory.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.",
                           param="response_id", code="not_found")
        return stored[0]


async def _events_only(chunks):
    """The serving loop's events less what Responses streams do not have: empty chunks
    (text held back by a parser) and the chat API's closing `[DONE]`."""
    async for chunk in chunks:
        if chunk not in ("data: \n\n", "data: [DONE]\n\n"):
            yield chunk


def add_responses_routes(app, serving, chat):
    responses = ServingResponses(serving, chat)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return JSONResponse(responses.retrieve(response_id))

