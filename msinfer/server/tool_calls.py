"""Tool calls in Qwen2.5's and Qwen3's format (vLLM's `hermes` parser): the chat template
renders the request's `tools`, the model answers with any text and then
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, which come back as
`tool_calls` (whole, or streamed as deltas: the call's id, type and name first, then its
arguments as they arrive).

tool_choice: "auto" (the default with tools) parses whatever the model writes; "none" renders
no tools and parses nothing (vLLM with --exclude-tools-when-tool-choice-none; OpenAI: no
call); "required" and a named function force calls with the grammar engine, in the model's own
format: a Lark grammar of `<tool_call>` blocks whose JSON is the schema {"name": one of the
tools (or the named one), "arguments": that tool's parameters}.
"""
import json
import re
import uuid

from ..engine.structured import grammar_of, marker, refuse
from ..engine.text import GrowingText, Search

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
# what may still close a block: the outer object's "}", whitespace and the end tag
_CLOSING = re.compile(r"\s*\}?\s*(?:<(?:/(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l(?:>)?)?)?)?)?)?)?)?)?)?)?)?$")
_JSON_OPTIONS = {"whitespace_flexible": False}


def _prefixes(*parts):
    """A regex that matches every beginning of what `parts` match one after another: a str
    part is literal text, a 1-tuple a regex that matches every beginning of its own."""
    pattern = ""
    for part in reversed(parts):
        for step in reversed(part if isinstance(part, tuple) else tuple(map(re.escape, part))):
            pattern = f"{step}(?:{pattern})?"
    return re.compile(f"(?:{pattern})?\\Z")


# every beginning of what _NAME matches: a block's body that is none cannot become a call's
# header by growing
_HEADER_SO_FAR = _prefixes((r"\s*",), "{", (r"\s*",), '"name"', (r"\s*",), ":", (r"\s*",), '"',
                           (r'(?:[^"\\]|\\.)*\\?',), '"', (r"\s*",), ",", (r"\s*",),
                           '"arguments"', (r"\s*",), ":")


def check_tools(tools, tool_choice):
    """The request's tools as {name: parameters schema}, and its tool_choice as "auto",
    "none", "required" or a tool's name. Refuses (naming the field) a tool that is not a
    function with a name, parameters that are not a JSON schema the grammar engine compiles,
    and a tool_choice naming no given tool."""
    functions = {}
    for i, tool in enumerate(tools or ()):
        field = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise refuse(f"{field}.type", "only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise refuse(f"{field}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise refuse(f"{field}.function.name", "must be a non-empty string")
        if name in functions:
            raise refuse(f"{field}.function.name", f"{name!r} is given twice")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        # the engine compiles each tool's schema now: a bad one is this request's 400
        grammar_of({"json": parameters}, f"{field}.function.parameters")
        functions[name] = parameters
    if tool_choice is None:
        choice = "auto" if functions else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise refuse("tool_choice", f"{tool_choice!r}: use 'auto', 'none', 'required' or "
                                        f"{{'type': 'function', 'function': {{'name': ...}}}}")
        choice = tool_choice
    else:
        name = (tool_choice.get("function") or {}).get("name") if isinstance(
            tool_choice, dict) else None
        if not isinstance(name, str):
            raise refuse("tool_choice", "a named tool_choice is {'type': 'function', "
                                        "'function': {'name': ...}}")
        choice = name
    if choice not in ("auto", "none") and not functions:
        raise refuse("tool_choice", f"{choice!r} needs tools")
    if choice not in ("auto", "none", "required") and choice not in functions:
        raise refuse("tool_choice", f"names the tool {choice!r}, which is not among the tools "
                                    f"given ({', '.join(functions)})")
    return functions, choice


def forcing_grammar(functions, choice, parallel=True, token_id=None):
    """structured_outputs that force one or more calls (tool_choice "required"; one with
    `parallel` false, OpenAI's parallel_tool_calls) or one call of the named tool, in Qwen's
    format (its tags as the tokenizer's own tokens where `token_id`, its token_to_id, has
    them); None for "auto" and "none"."""
    if choice in ("auto", "none"):
        return None
    names = list(functions) if choice == "required" else [choice]
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                                "arguments": functions[name]},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name in names]
    schema = dict(calls[0] if len(calls) == 1 else {"anyOf": calls})
    schema["x-guidance"] = _JSON_OPTIONS
    repeat = ' ("\\n" call)*' if choice == "required" and parallel else ""
    lark = (f"start: call{repeat}\n"
            f"call: {marker(OPEN, token_id)} \"\\n\" body \"\\n\" {marker(CLOSE, token_id)}\n"
            f"body: %json {json.dumps(schema)}\n")
    return {"grammar": lark}


def new_call_id():
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parse_whole(text):
    """(content before the first call or None, [{"name", "arguments" (a JSON string)}]) of a
    finished answer; text that holds no well-formed call is all content."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in re.findall(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + "|$)",
                            text[start:], flags=re.S):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []  # not a call after all: the model's text as it is
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"name": call["name"],
                      "arguments": json.dumps(arguments, ensure_ascii=False)})
    content = text[:start]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """Turns one streamed choice's text deltas into content deltas and tool call deltas
    ({"index", "id", "type", "function": {"name", "arguments"}}, as the openai SDK
    accumulates them): content until `<tool_call>`, then per call its name once known and its
    arguments as they come, holding back what may be the block's closing. A delta costs what
    it adds: the text is kept in pieces, each tag is searched for in the new text only, a
    block is read whole once (when it closes), and an open one's arguments from what of them
    was not sent. The last feed is the one `finished`."""

    def __init__(self):
        self._text = GrowingText()
        self._content_sent = 0
        self._calls = []  # per call: [id, name sent?, characters of arguments sent]
        self._first = Search(OPEN)
        self._block = None  # the last block (_Block) once there is one

    def feed(self, delta, finished):
        """(content delta, [tool call deltas]) after `delta`; `finished` flushes all."""
        text = self._text
        text.append(delta)
        end = len(text)
        start = self._first(text, end)
        content_end = start if start is not None else end
        if start is None and not finished:
            content_end -= _partial(text[-len(OPEN):], OPEN)
        content = text[self._content_sent:content_end]
        self._content_sent = max(self._content_sent, content_end)
        if start is None:
            return content, []
        if self._block is None:
            self._block = _Block(0, start + len(OPEN))
        deltas = []
        while True:  # the last block, and those opened after it
            block = self._block
            following = block.next_open(text, end)
            body_end = following if following is not None else end
            close = block.close(text, end)
            closed = following is not None or finished
            if close is not None and close + len(CLOSE) <= body_end:
                body_end, closed = close, True
            if not block.settled:
                deltas += self._call_deltas(block, body_end, closed)
            if following is None:
                return content, deltas
            self._block = _Block(block.index + 1, following + len(OPEN))

    def _call_deltas(self, block, body_end, closed):
        while len(self._calls) <= block.index:
            self._calls.append([new_call_id(), False, 0])
        call = self._calls[block.index]
        if closed:  # the body is final: read whole, once
            block.settled = True
            return _closed_call_deltas(block.index, call, self._text[block.start:body_end])
        out = self._header_deltas(block, call, body_end) if block.arguments is None else []
        if block.arguments is None:
            return out
        unsent = self._text[block.arguments + call[2]:body_end]
        sendable = _CLOSING.search(unsent).start()  # what may be the closing waits
        if sendable:
            out.append({"index": block.index, "function": {"arguments": unsent[:sendable]}})
            call[2] += sendable
        return out

    def _header_deltas(self, block, call, body_end):
        """The name of an open block's call once its header ({"name": ..., "arguments": )
        is there; sets where its arguments start once something follows the header."""
        if block.unnamed:
            return []
        body = self._text[block.start:body_end]  # the header so far: short
        match = _NAME.match(body)
        if match is None:
            block.unnamed = _HEADER_SO_FAR.match(body) is None  # no name will come first
            return []
        out = []
        if not call[1]:
            call[1] = True
            out.append(_delta(block.index, call[0], _name(match), ""))
        if match.end() < len(body):  # not whitespace only: the arguments have begun
            block.arguments = block.start + match.end()
        return out

    @property
    def called(self):
        """Whether a call (its name at least) was sent."""
        return any(named for _, named, _ in self._calls)


class _Block:
    """A `<tool_call>` block of a stream: where its body starts, the searches for its
    closing tag and for the next block, and where its arguments start once its header is
    whole (None before; `unnamed` once no name can come first)."""

    def __init__(self, index, start):
        self.index, self.start = index, start
        self.close, self.next_open = Search(CLOSE, start), Search(OPEN, start)
        self.arguments, self.unnamed, self.settled = None, False, False


def _closed_call_deltas(index, call, body):
    """The deltas a closed block's `body` adds to what `call` sent of it."""
    match = _NAME.match(body)
    if match is None:
        try:  # a block whose name does not come first: whole, once closed
            parsed = json.loads(body)
            name = parsed["name"]
            arguments = json.dumps(parsed.get("arguments", {}), ensure_ascii=False)
        except (ValueError, KeyError, TypeError):
            return []
        if call[1]:
            return []
        call[1], call[2] = True, len(arguments)
        return [_delta(index, call[0], name, arguments)]
    out = []
    if not call[1]:
        call[1] = True
        out.append(_delta(index, call[0], _name(match), ""))
    arguments = body[match.end():]
    end = len(arguments.rstrip())
    if end and arguments[end - 1] == "}":
        end -= 1  # the outer object's closing brace
    arguments = arguments[:end].rstrip()
    if len(arguments) > call[2]:
        out.append({"index": index, "function": {"arguments": arguments[call[2]:]}})
        call[2] = len(arguments)
    return out


def _name(match):
    return json.loads(f'"{match.group(1)}"')


def _delta(index, call_id, name, arguments):
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _partial(end, tag):
    """How many of the last characters of `end` (the text's end, len(tag) or more of it)
    may be the start of `tag`."""
    for k in range(len(tag) - 1, 0, -1):
        if end.endswith(tag[:k]):
            return k
    return 0
