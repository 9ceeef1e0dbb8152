"""POST /v1/chat/completions: messages through the chat template, and the
`chat.completion` response and `chat.completion.chunk`s (the role first)."""
import time
import uuid

from . import protocol as p
from .reasoning import StreamSplitter, split_whole
from .serving import sampling_params, token_text, tokenize


class ServingChat:
    def __init__(self, serving):
        self.serving = serving

    async def create(self, body, request):
        """The response to a ChatCompletionRequest: JSON, or server-sent events when streamed.
        Without max_tokens, the answer may fill the rest of the context."""
        serving = self.serving
        headers = serving.check(body)
        kwargs = body.chat_template_kwargs or {}
        text = tokenize(lambda messages: serving.tokenizer.apply_chat_template(messages,
                                                                               **kwargs),
                        [m.as_template_message() for m in body.messages])
        ids = tokenize(serving.tokenizer.encode, text)
        max_tokens = body.token_budget() or max(1, serving.config.max_model_len - len(ids))
        fmt = ChatFormat(body, serving.model_name, serving.tokenizer,
                         serving.config.reasoning_parser)
        params = sampling_params(body, max_tokens, body.logprobs_count())
        return await serving.generate(fmt, [(text, ids)], params, request, headers)


class ChatFormat:
    def __init__(self, body, model_name, tokenizer, reasoning_parser=None):
        self.body, self.model, self.tokenizer = body, model_name, tokenizer
        self.reasoning = reasoning_parser
        self._splitters = {}  # choice index -> StreamSplitter, with a reasoning parser
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
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

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
            splitter = self._splitters.setdefault(index, StreamSplitter())
            reasoning, content = splitter.feed(delta.text, finish_reason is not None)
            message = p.ChatDelta(content=content or None, reasoning_content=reasoning or None)
        return self._chunk([p.ChatStreamChoice(
            index=index, delta=message, finish_reason=finish_reason,
            logprobs=self._logprobs(delta.token_ids, delta.logprobs))])

    def usage_chunk(self, usage):
        return self._chunk([], usage)

    def response(self, streams, usage):
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            choices=[p.ChatChoice(index=i, message=self._message(s.text),
                                  finish_reason=s.finish_reason,
                                  logprobs=self._logprobs(s.token_ids, s.logprobs))
                     for i, s in enumerate(streams)])

    def _message(self, text):
        if not self.reasoning:
            return p.AssistantMessage(content=text)
        reasoning, content = split_whole(text)
        return p.AssistantMessage(content=content, reasoning_content=reasoning)
