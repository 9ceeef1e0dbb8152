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

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
# what may still close a block: the outer object's "}", whitespace and the end tag
_CLOSING = re.compile(r"\s*\}?\s*(?:<(?:/(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l(?:>)?)?)?)?)?)?)?)?)?)?)?)?$")
_JSON_OPTIONS = {"whitespace_flexible": False}


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
    arguments as they come, holding back what may be the block's closing."""

    def __init__(self):
        self._text = ""
        self._content_sent = 0
        self._calls = []  # per call: [id, name sent?, characters of arguments sent]

    def feed(self, delta, finished):
        """(content delta, [tool call deltas]) after `delta`; `finished` flushes all."""
        self._text += delta
        text = self._text
        start = text.find(OPEN)
        content_end = start if start >= 0 else len(text)
        if start < 0 and not finished:
            content_end = _without_partial(text, OPEN)
        content = text[self._content_sent:content_end]
        self._content_sent = max(self._content_sent, content_end)
        if start < 0:
            return content, []
        deltas = []
        blocks = text[start:].split(OPEN)[1:]
        for index, block in enumerate(blocks):
            closed = CLOSE in block or index < len(blocks) - 1 or finished
            deltas += self._call_deltas(index, block.split(CLOSE)[0], closed)
        return content, deltas

    def _call_deltas(self, index, body, closed):
        while len(self._calls) <= index:
            self._calls.append([new_call_id(), False, 0])
        call = self._calls[index]
        match = _NAME.match(body)
        if match is None:
            if not closed:
                return []
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
            out.append(_delta(index, call[0], json.loads(f'"{match.group(1)}"'), ""))
        arguments = body[match.end():]
        if closed:
            end = len(arguments.rstrip())
            if end and arguments[end - 1] == "}":
                end -= 1  # the outer object's closing brace
            arguments = arguments[:end].rstrip()
        else:
            arguments = arguments[:_CLOSING.search(arguments).start()]
        if len(arguments) > call[2]:
            out.append({"index": index, "function": {"arguments": arguments[call[2]:]}})
            call[2] = len(arguments)
        return out

    @property
    def called(self):
        """Whether a call (its name at least) was sent."""
        return any(named for _, named, _ in self._calls)


def _delta(index, call_id, name, arguments):
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _without_partial(text, tag):
    """The length of `text` without an ending that may be the start of `tag`."""
    for k in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)
