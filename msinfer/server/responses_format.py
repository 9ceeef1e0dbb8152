"""A chat completion's answer as the Responses API gives it (responses.py): output items
whole, or streamed as Responses events, translated from the chat format's chunks."""
import json
import time
import uuid

_STATUS = {"length": "incomplete"}  # finish reason -> response status (others: completed)


class Events(list):
    """Several Responses events where the serving loop writes one `data:` line."""

    usage = None  # the serving loop's continuous-usage slot (never asked for here)

    def model_dump_json(self):
        return "\n\ndata: ".join(json.dumps(event) for event in self)


class Body(dict):
    """A finished response as the serving loop returns it (its model_dump)."""

    def model_dump(self, mode=None):
        return dict(self)


def _new_id(prefix):
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text, status="completed", item_id=None):
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id, name, arguments, status="completed", item_id=None):
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def usage_of(usage):
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponsesFormat:
    """The serving loop's format (serving.py) of a Responses request, over `chat` (the
    ChatFormat of the chat request it runs as)."""

    def __init__(self, body, chat_body, chat, history, memory):
        self.body, self.request, self.chat = chat_body, body, chat
        self.history, self.memory = history, memory
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.seq = 0
        self.items = []  # streamed output items, in order
        self.message = None  # the streamed message item, once text came
        self.pieces = []  # ... and its text so far, joined once, at the end
        self.calls = {}  # tool-call index -> its streamed item
        self.finish_reason = None

    def _response(self, status, output, usage=None):
        r = self.request
        return Body({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.chat.model, "output": output, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None, "error": None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [],
            "temperature": r.temperature, "top_p": r.top_p, "store": r.store,
            "metadata": r.metadata or {}, "text": r.text or {"format": {"type": "text"}},
            "truncation": "disabled"})

    def _event(self, type_, **fields):
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq - 1, **fields}

    def _remember(self, response, text, calls):
        """Keep the conversation after this response, for a later previous_response_id."""
        if not self.request.store:
            return
        turn = {"role": "assistant", "content": text or ""}
        if calls:
            turn["tool_calls"] = [{"id": c["call_id"], "type": "function", "function": {
                "name": c["name"], "arguments": c["arguments"]}} for c in calls]
        asked = [m.as_template_message() for m in self.body.messages]
        if self.request.instructions:  # instructions apply to one response only (OpenAI's)
            asked = asked[1:]
        self.memory.put(self.id, dict(response), asked + [turn])

    # -- whole ---------------------------------------------------------------------------------
    def response(self, streams, usage):
        choice = self.chat.response(streams, usage).choices[0]
        message, output = choice.message, []
        if message.reasoning_content:
            output.append({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                           "content": [{"type": "reasoning_text",
                                        "text": message.reasoning_content}]})
        if message.content:
            output.append(message_item(message.content))
        calls = [call_item(c.id, c.function.name, c.function.arguments)
                 for c in message.tool_calls]
        output += calls
        response = self._response(_STATUS.get(choice.finish_reason, "completed"), output,
                                  usage_of(usage))
        self._remember(response, message.content, calls)
        return response

    # -- streamed ------------------------------------------------------------------------------
    def opening_chunks(self, n):
        started = self._response("in_progress", [])
        return [Events([self._event("response.created", response=started),
                        self._event("response.in_progress", response=started)])]

    def chunk(self, index, delta, finish_reason):
        choice = self.chat.chunk(index, delta, finish_reason).choices[0]
        self.finish_reason = choice.finish_reason or self.finish_reason
        events = Events()
        if choice.delta.content:
            events += self._text(choice.delta.content)
        for call in choice.delta.tool_calls or ():
            events += self._call(call)
        return events

    def _text(self, text):
        events = []
        if self.message is None:
            self.message = message_item("", "in_progress")
            self.message["content"] = []
            self.items.append(self.message)
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.items) - 1,
                                      item=dict(self.message)))
            events.append(self._event("response.content_part.added",
                                      item_id=self.message["id"],
                                      output_index=len(self.items) - 1, content_index=0,
                                      part={"type": "output_text", "text": "",
                                            "annotations": []}))
        self.pieces.append(text)
        events.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                  output_index=self.items.index(self.message),
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, call):
        events, item = [], self.calls.get(call["index"])
        function = call.get("function") or {}
        if item is None:
            item = call_item(call.get("id"), function.get("name"), "", "in_progress")
            self.calls[call["index"]] = item
            self.items.append(item)
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.items) - 1, item=dict(item)))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self.items.index(item),
                                      delta=function["arguments"]))
        return events

    def usage_chunk(self, usage):
        """The stream's end: every item done, then response.completed (or .incomplete)."""
        events, output, text = Events(), [], "".join(self.pieces)
        for index, item in enumerate(self.items):
            if item is self.message:
                done = message_item(text, item_id=item["id"])
                part = done["content"][0]
                events += [self._event("response.output_text.done", item_id=item["id"],
                                       output_index=index, content_index=0, text=text,
                                       logprobs=[]),
                           self._event("response.content_part.done", item_id=item["id"],
                                       output_index=index, content_index=0, part=part)]
            else:
                done = {**item, "status": "completed"}
                events.append(self._event("response.function_call_arguments.done",
                                          item_id=item["id"], output_index=index,
                                          name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=done))
            output.append(done)
        status = _STATUS.get(self.finish_reason, "completed")
        response = self._response(status, output, usage_of(usage))
        events.append(self._event(f"response.{status}", response=dict(response)))
        calls = [o for o in output if o["type"] == "function_call"]
        self._remember(response, text, calls)
        return events
