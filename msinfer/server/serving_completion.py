"""POST /v1/completions: prompts (text or token ids, one or a batch) and the
`text_completion` response and chunks."""
import time
import uuid

from ..engine.tokenizer import encode_prompts
from . import protocol as p
from .guided import structured_outputs
from .serving import request_check, sampling_params, token_text, tokenize


class ServingCompletion:
    def __init__(self, serving):
        self.serving = serving

    async def create(self, body, request):
        """The response to a CompletionRequest: JSON, or server-sent events when streamed."""
        serving = self.serving
        headers = serving.check(body)
        structured = request_check(structured_outputs, body)
        prompts = encode_prompts(body.prompts(),
                                 lambda text: tokenize(serving.tokenizer.encode, text))
        fmt = CompletionsFormat(body, serving.model_name, serving.tokenizer)
        params = sampling_params(body, body.max_tokens or 16, body.logprobs, structured)
        return await serving.generate(fmt, prompts, params, request, headers)


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
            token = token_text(self.tokenizer, token_id)
            result.text_offset.append(offset)
            offset += len(token)
            result.tokens.append(token)
            result.token_logprobs.append(lp[token_id])
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:self.top_n]
            result.top_logprobs.append({token_text(self.tokenizer, t): v for t, v in top})
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

    def response(self, streams, usage):
        return p.CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            choices=[p.CompletionChoice(index=i, text=s.text, finish_reason=s.finish_reason,
                                        logprobs=self._logprobs(s.token_ids, s.logprobs))
                     for i, s in enumerate(streams)])
