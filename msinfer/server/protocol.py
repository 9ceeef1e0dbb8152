"""The OpenAI API's request and response shapes, as pydantic models (one place for all).

Requests accept fields msinfer does not know, as vLLM does: they are ignored, logged and named
in the response's `X-Msinfer-Ignored-Fields` header (`ignored_fields()`), so clients written
for vLLM or OpenAI (guidellm, lm-eval, `vllm bench serve`, aiperf) run unmodified. Known fields
are validated by type and range (400). Fields msinfer knows but cannot honour yet (suffix,
...) are refused by `unsupported()` with the field's name, never silently ignored; a value
that asks for nothing (`suffix: null`, `tools: []`, ...) is accepted.
"""
import json
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.tokenizer import prompt_list

# Bounds on `stop`: every stop string is looked for in the text after every token, on every
# rank. OpenAI takes up to 4; clients written for vLLM send a few more (chat formats' role
# markers), so 16, each of at most 256 characters.
MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per prompt (n); each is a sequence of its own in the engine
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 128  # stop_token_ids per request (each is checked every step)
MAX_LOGPROBS = 20  # top entries per token (logprobs, top_logprobs, prompt_logprobs): vLLM's


def _extras(model, prefix=""):
    """The dotted names of the fields `model` (a pydantic model) was given but does not know."""
    return [prefix + name for name in (model.model_extra or {})]


def lone_surrogate(model):
    """The name of `model`'s first field holding a string with a lone UTF-16 surrogate (JSON
    allows "\\ud800"; no tokenizer can encode it), else None."""
    for name in type(model).model_fields:
        if _has_surrogate(getattr(model, name)):
            return name
    return None


def _has_surrogate(value):
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, BaseModel):
        return lone_surrogate(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_surrogate(v) for v in value)
    return False


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    # vLLM's: usage (so far) on every chunk, not only in the last one
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: Optional[int] = Field(default=None, ge=0)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    # vLLM's: each prompt token's logprob and this many most likely ones at its position
    # (-1, vLLM's whole vocabulary, is refused: out_of_bounds)
    prompt_logprobs: Optional[int] = Field(default=None, ge=-1)
    # vLLM's: only requests with the same salt share prefix-cached blocks
    cache_salt: Optional[str] = Field(default=None, max_length=1024)
    # Fields (vLLM's and OpenAI's) msinfer knows but does not do yet: only the values that
    # ask for nothing are accepted (unsupported())
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # a constraint on the output, enforced while decoding (server/guided.py): OpenAI's, and
    # vLLM's (structured_outputs, and its older guided_* fields)
    response_format: Optional[Any] = None
    structured_outputs: Optional[dict] = None
    guided_json: Optional[Union[dict, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None  # calls are parsed however many there are

    @field_validator("temperature", "top_p", "top_k", "n", "stream", "ignore_eos",
                     "stop_token_ids", "min_tokens", "include_stop_str_in_output",
                     "skip_special_tokens", mode="before")
    @classmethod
    def _null_is_the_default(cls, value, info):
        """`null` for a field with a default means the default (as vLLM and OpenAI take it)."""
        if value is None:
            default = cls.model_fields[info.field_name].get_default(call_default_factory=True)
            return default
        return value

    def unsupported(self):
        """(field, why) for the first field set to something msinfer does not do, else None."""
        if self.prompt_logprobs is not None and self.stream:  # as vLLM
            return "prompt_logprobs", "prompt_logprobs are not available with stream=true"
        if self.include_stop_str_in_output:
            return "include_stop_str_in_output", "only include_stop_str_in_output=false is " \
                                                 "supported"
        if not self.skip_special_tokens:
            return "skip_special_tokens", "only skip_special_tokens=true is supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options needs stream=true"
        return None

    def ignored_fields(self):
        """The names of the fields given that msinfer does not know (and so ignores)."""
        names = _extras(self)
        if self.stream_options is not None:
            names += _extras(self.stream_options, "stream_options.")
        return names

    def out_of_bounds(self, limits):
        """(field, why) for a field beyond msinfer's bounds (a 400 naming it), else None;
        `limits`: the served engine's EngineLimits, whose running batch (max_num_seqs)
        bounds n too."""
        max_num_seqs = limits.max_num_seqs
        if not 1 <= self.n <= MAX_N:
            return "n", f"n={self.n}: choices per prompt must be 1..{MAX_N}"
        if self.n > max_num_seqs:
            return "n", (f"n={self.n}: choices per prompt must be at most the server's "
                         f"--max-num-seqs {max_num_seqs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            return "prompt_logprobs", (f"prompt_logprobs={self.prompt_logprobs}: must be "
                                       f"0..{MAX_LOGPROBS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            return "stop_token_ids", (f"{len(self.stop_token_ids)} stop_token_ids; at most "
                                      f"{MAX_STOP_TOKEN_IDS} are accepted")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            return "stop", (f"{len(stops)} stop strings; at most {MAX_STOP_STRINGS} are "
                            f"accepted")
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            return "stop", (f"a stop string of {len(longest)} characters; each may have at "
                            f"most {MAX_STOP_CHARS}")
        return None

    def sequences_per_prompt(self):
        """Sequences the engine runs for each prompt."""
        return self.n

    def sequences(self):
        """Sequences the engine runs for the whole request, and the field that sets it."""
        return self.sequences_per_prompt(), "n"

    def stop_strings(self):
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)

    @property
    def include_usage(self):
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self):
        """Usage on every chunk (vLLM: continuous_usage_stats, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    # 0 only with echo or prompt_logprobs: the prompt is scored, nothing generated
    max_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # the prompt before the completion, in the text and (with logprobs) in the logprobs
    echo: bool = False
    # best_of sequences per prompt, of which the n with the highest cumulative logprob return
    best_of: Optional[int] = Field(default=None, ge=1)
    suffix: Optional[str] = None

    @field_validator("echo", mode="before")
    @classmethod
    def _null_echo_is_false(cls, value):
        return False if value is None else value

    def unsupported(self):
        if self.suffix:
            return "suffix", ("suffix is not supported: Qwen models have no fill-in-the-middle "
                              "format in the completions API")
        if self.tools:
            return "tools", "tools are taken by /v1/chat/completions only"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice is taken by /v1/chat/completions only"
        if self.best_of and self.best_of > self.n and self.stream:  # as OpenAI and vLLM
            return "best_of", "best_of > n cannot be streamed"
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            return "max_tokens", "max_tokens=0 needs echo=true or prompt_logprobs"
        return super().unsupported()

    def out_of_bounds(self, limits):
        if self.best_of is not None:
            if self.best_of < self.n:
                return "best_of", f"best_of={self.best_of} must be at least n={self.n}"
            most = min(MAX_N, limits.max_num_seqs)
            if self.best_of > most:
                return "best_of", (f"best_of={self.best_of}: sequences per prompt must be at "
                                   f"most {most} (at most {MAX_N}, and the server's "
                                   f"--max-num-seqs)")
        return super().out_of_bounds(limits)

    def sequences_per_prompt(self):
        return max(self.n, self.best_of or 1)

    def sequences(self):
        prompts = len(self.prompts())
        return prompts * self.sequences_per_prompt(), "prompt" if prompts > 1 else "n"

    def prompt_logprobs_count(self):
        """Top entries per prompt token the engine computes: echo with logprobs needs the
        prompt's (OpenAI's echo), prompt_logprobs asks for them (vLLM's); None for none."""
        counts = [c for c in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if c is not None]
        return max(counts) if counts else None

    def prompts(self):
        """The prompt as a list of prompts, each a string or a list of token ids."""
        return prompt_list(self.prompt) or [""]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None  # an assistant's calls, sent back with the results
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    def as_template_message(self):
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role,
                   "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _template_tool_call(call):
    """A tool call as chat templates read it: arguments as an object, not a JSON string
    (Qwen2.5's template writes them with tojson; vLLM parses them the same way)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the string as it came
    return {**call, "function": function}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    # more variables for the chat template, as vLLM takes them ({"enable_thinking": false})
    chat_template_kwargs: Optional[dict[str, Any]] = None
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def unsupported(self):
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        return super().unsupported()

    def ignored_fields(self):
        names = super().ignored_fields()
        for i, message in enumerate(self.messages):
            names += _extras(message, f"messages.{i}.")
        return names

    def token_budget(self):
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self):
        return (self.top_logprobs or 0) if self.logprobs else None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None  # OpenAI's, cached_tokens


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # null for an echoed prompt's first token (nothing before it scores it)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one entry of a prompt position's {token id: ...}."""
    logprob: float
    rank: Optional[int] = None  # 1 = most likely; null: the prompt token, below the top ones
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: PromptLogprob}
PromptLogprobs = list[Optional[dict[str, PromptLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Optional[str] = None  # with --reasoning-parser: the thinking
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobs] = None  # vLLM's, of the templated prompt


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    # {"index", and the first time "id", "type", "function": {"name"}; "function":
    # {"arguments"} pieces} per call (server/tool_calls.py)
    tool_calls: Optional[list[dict]] = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "msinfer"
    root: str  # the checkpoint served (vLLM: the model path; `vllm bench serve` reads it)
    parent: Optional[str] = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) and /version ----

class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False

    def unsupported(self):
        if self.return_token_strs:
            return "return_token_strs", "return_token_strs is not supported"
        return None

    def ignored_fields(self):
        return _extras(self)


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None
    tools: Optional[list] = None

    def unsupported(self):
        if self.return_token_strs:
            return "return_token_strs", "return_token_strs is not supported"
        if self.continue_final_message:
            return "continue_final_message", "continue_final_message is not supported"
        if self.chat_template is not None:
            return "chat_template", "only the model's own chat template is used"
        return None

    def ignored_fields(self):
        names = _extras(self)
        for i, message in enumerate(self.messages):
            names += _extras(message, f"messages.{i}.")
        return names


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    tokens: list[int]

    def unsupported(self):
        return None

    def ignored_fields(self):
        return _extras(self)


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
