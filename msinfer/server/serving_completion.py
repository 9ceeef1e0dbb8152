"""POST /v1/completions: prompts (text or token ids, one or a batch) and the
`text_completion` response and chunks; echo, prompt_logprobs and best_of."""
import time
import uuid

from ..engine.tokenizer import encode_prompts
from . import protocol as p
from .context_length import check_context
from .guided import structured_outputs
from .serving import (request_check, sampling_params, token_text, tokenize,
                      vllm_prompt_logprobs)


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
        logprobs = body.logprobs
        if body.sequences_per_prompt() > body.n and logprobs is None:
            logprobs = 0  # best_of ranks sequences by the sampled tokens' logprobs
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        for _, ids in prompts:
            check_context(len(ids), max_tokens, serving.engine_config.max_model_len, "prompt")
        prompt_logprobs = body.prompt_logprobs_count()
        if max_tokens == 0 and prompt_logprobs is None:  # echo alone: the prompt is scored
            prompt_logprobs = 0  # (one prefill), nothing generated, no logprobs returned
        params = sampling_params(body, max_tokens, logprobs, structured, prompt_logprobs)
        serving.metrics.observe_request_params(body.n)
        return await serving.generate(fmt, prompts, params, request, headers)


class CompletionsFormat:
    def __init__(self, body, model_name, tokenizer):
        self.body, self.model, self.tokenizer = body, model_name, tokenizer
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.top_n = body.logprobs

    def _logprobs(self, token_ids, logprobs, echoed=None):
        """OpenAI's logprobs of the generated tokens, after those of the prompt when echoed
        (echoed: the stream whose prompt goes first; its first token's entries are null)."""
        if self.top_n is None:
            return None
        entries = list(zip(token_ids, logprobs))
        if echoed is not None:
            scored = echoed.prompt_logprobs or [None] * len(echoed.prompt_token_ids)
            entries = list(zip(echoed.prompt_token_ids, scored)) + entries
        result = p.CompletionLogprobs()
        offset = 0
        for token_id, lp in entries:
            token = token_text(self.tokenizer, token_id)
            result.text_offset.append(offset)
            offset += len(token)
            result.tokens.append(token)
            if lp is None:  # the prompt's first token: nothing before it scores it
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(lp[token_id])
            top = sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))[:self.top_n]
            result.top_logprobs.append({token_text(self.tokenizer, t): v for t, v in top})
        return result

    def _prompt_text(self, stream):
        if stream.prompt_text is not None:
            return stream.prompt_text
        return self.tokenizer.decode(stream.prompt_token_ids)

    def _prompt_logprobs(self, stream):
        if self.body.prompt_logprobs is None or stream.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, stream.prompt_logprobs,
                                    self.body.prompt_logprobs)

    def opening_chunks(self, n):
        return []

    def chunk(self, index, delta, finish_reason):
        # echo: the prompt (and its logprobs) goes first, in a stream's first chunk
        echoed = delta.stream if self.body.echo else None
        text = (self._prompt_text(echoed) if echoed else "") + delta.text
        choice = p.CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                    logprobs=self._logprobs(delta.token_ids, delta.logprobs,
                                                            echoed))
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                    choices=[choice])

    def usage_chunk(self, usage):
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                    choices=[], usage=usage)

    def response(self, streams, usage):
        choices = []
        for i, s in enumerate(streams):
            echoed = s if self.body.echo else None
            choices.append(p.CompletionChoice(
                index=i, text=(self._prompt_text(s) if echoed else "") + s.text,
                finish_reason=s.finish_reason,
                logprobs=self._logprobs(s.token_ids, s.logprobs, echoed),
                prompt_logprobs=self._prompt_logprobs(s)))
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                    usage=usage, choices=choices)
