"""POST /v1/chat/completions: messages through the chat template, and the
`chat.completion` response and `chat.completion.chunk`s (the role first)."""
import time
import uuid

from ..engine.structured import AFTER_THINK
from . import protocol as p
from .context_length import check_context
from .guided import structured_outputs
from .reasoning import StreamSplitter, prompt_opens_thinking, split_whole
from .serving import (ApiError, request_check, sampling_params, token_bytes, token_text,
                      tokenize, vllm_prompt_logprobs)
from .tool_calls import ToolCallStream, check_tools, forcing_grammar, new_call_id, parse_whole


class ServingChat:
    def __init__(self, serving):
        self.serving = serving

    async def create(self, body, request):
        """The response to a ChatCompletionRequest: JSON, or server-sent events when streamed.
        Without max_tokens, the answer may fill the rest of the context."""
        headers = self.serving.check(body)
        fmt, prompt, params = self.prepare(body)
        return await self.serving.generate(fmt, [prompt], params, request, headers)

    def prepare(self, body):
        """(ChatFormat, (templated text, token ids), SamplingParams) of a checked request."""
        serving = self.serving
        functions, tool_choice = request_check(check_tools, body.tools, body.tool_choice)
        structured = request_check(structured_outputs, body)
        forced = forcing_grammar(functions, tool_choice, body.parallel_tool_calls is not False,
                                 serving.tokenizer.token_to_id)
        if forced and structured:
            raise ApiError(400, "tool_choice: a forced tool call ('required' or a named "
                                "function) cannot be combined with response_format or "
                                "structured_outputs", param="tool_choice")
        kwargs = dict(body.chat_template_kwargs or {})
        if tool_choice != "none":  # "none" renders no tools: the model cannot call one
            kwargs["tools"] = body.tools
        text = tokenize(lambda messages: serving.tokenizer.apply_chat_template(messages,
                                                                               **kwargs),
                        [m.as_template_message() for m in body.messages])
        ids = tokenize(serving.tokenizer.encode, text)
        max_model_len = serving.engine_config.max_model_len
        max_tokens = body.token_budget() or max(1, max_model_len - len(ids))
        check_context(len(ids), max_tokens, max_model_len, "messages")
        fmt = ChatFormat(body, serving.model_name, serving.tokenizer,
                         serving.config.reasoning_parser, tool_choice,
                         thinking=prompt_opens_thinking(text))
        constraint = forced or structured
        if constraint and serving.config.reasoning_parser:
            # a thinking model thinks first, unconstrained, as vLLM lets it
            constraint = {**constraint, AFTER_THINK: True}
        params = sampling_params(body, max_tokens, body.logprobs_count(), constraint,
                                 body.prompt_logprobs)
        serving.metrics.observe_request_params(body.n)
        return fmt, (text, ids), params


class ChatFormat:
    def __init__(self, body, model_name, tokenizer, reasoning_parser=None, tool_choice="none",
                 thinking=False):
        """thinking: the prompt opened a think block (reasoning.prompt_opens_thinking)."""
        self.body, self.model, self.tokenizer = body, model_name, tokenizer
        self.reasoning = reasoning_parser
        self.thinking = thinking
        self._splitters = {}  # choice index -> StreamSplitter, with a reasoning parser
        self.parse_tools = tool_choice != "none"  # the answer's <tool_call>s are tool_calls
        self._tool_streams = {}  # choice index -> ToolCallStream, when parsing tools
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
        token = token_text(self.tokenizer, token_id)
        return {"token": token, "logprob": logprob,
                "bytes": list(token_bytes(self.tokenizer, token_id))}

    def opening_chunks(self, n):
        return [self._chunk([p.ChatStreamChoice(index=i, delta=p.ChatDelta(role="assistant",
                                                                           content=""))])
                for i in range(n)]

    def _chunk(self, choices, usage=None):
        return p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                     choices=choices, usage=usage)

    def chunk(self, index, delta, finish_reason):
        message = p.ChatDelta(content=delta.text)
        if self.reasoning:
            splitter = self._splitters.setdefault(index, StreamSplitter(self.thinking))
            reasoning, content = splitter.feed(delta.text, finish_reason is not None)
            message = p.ChatDelta(content=content or None, reasoning_content=reasoning or None)
        if self.parse_tools:
            calls = self._tool_streams.setdefault(index, ToolCallStream())
            content, tool_calls = calls.feed(message.content or "", finish_reason is not None)
            message.content, message.tool_calls = content or None, tool_calls or None
            finish_reason = _with_calls(finish_reason, calls.called)
        return self._chunk([p.ChatStreamChoice(
            index=index, delta=message, finish_reason=finish_reason,
            logprobs=self._logprobs(delta.token_ids, delta.logprobs))])

    def usage_chunk(self, usage):
        return self._chunk([], usage)

    def response(self, streams, usage):
        prompt_logprobs = None  # vLLM's, of the templated prompt (the same for every choice)
        if self.body.prompt_logprobs is not None and streams[0].prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(self.tokenizer, streams[0].prompt_logprobs,
                                                   self.body.prompt_logprobs)
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            prompt_logprobs=prompt_logprobs,
            choices=[self._choice(i, s) for i, s in enumerate(streams)])

    def _choice(self, index, stream):
        message = self._message(stream.text)
        return p.ChatChoice(index=index, message=message,
                            finish_reason=_with_calls(stream.finish_reason,
                                                      bool(message.tool_calls)),
                            logprobs=self._logprobs(stream.token_ids, stream.logprobs))

    def _message(self, text):
        reasoning, content = (split_whole(text, self.thinking) if self.reasoning
                              else (None, text))
        calls = []
        if self.parse_tools and content:
            content, calls = parse_whole(content)
        return p.AssistantMessage(
            content=content, reasoning_content=reasoning,
            tool_calls=[p.ToolCall(id=new_call_id(), function=p.FunctionCall(**call))
                        for call in calls])


def _with_calls(finish_reason, called):
    """An answer that ended by itself after calling tools finishes with "tool_calls"."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason
