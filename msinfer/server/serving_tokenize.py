"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the chat
template), POST /detokenize, GET /tokenizer_info. lm-evaluation-harness's remote tokenizer
and `vllm bench` use them; they run the same tokenizer and template as the completions.

The tokenizer runs as the checkpoint's tokenizer.json says: `add_special_tokens` is accepted
but changes nothing (Qwen's post-processor adds no special tokens either way).
"""
import json

import pydantic
from fastapi.exceptions import RequestValidationError

from . import protocol as p
from .serving import ApiError, ignored_fields_headers, refuse_lone_surrogates, tokenize

# The special tokens /tokenizer_info reports (null when the checkpoint names none); lm-eval
# reads eos_token, bos_token and pad_token.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ServingTokenize:
    def __init__(self, serving):
        self.serving = serving

    def _check(self, body):
        if body.model is not None and body.model not in self.serving.config.model_names:
            raise ApiError(404, f"The model `{body.model}` does not exist.",
                           param="model", code="model_not_found")
        refuse_lone_surrogates(body)
        refused = body.unsupported()
        if refused:
            raise ApiError(400, f"{refused[0]}: {refused[1]}", param=refused[0])
        return ignored_fields_headers(body.ignored_fields())

    async def tokenize(self, request):
        """(TokenizeResponse, headers) for a /tokenize body: `prompt` or chat `messages`."""
        data = await _json(request)
        kind = (p.TokenizeChatRequest if isinstance(data, dict) and "messages" in data
                else p.TokenizeCompletionRequest)
        body = _validate(kind, data)
        headers = self._check(body)
        tokenizer = self.serving.tokenizer
        if isinstance(body, p.TokenizeChatRequest):
            text = tokenize(lambda m: tokenizer.apply_chat_template(
                m, add_generation_prompt=body.add_generation_prompt, tools=body.tools or None),
                [m.as_template_message() for m in body.messages])
        else:
            text = body.prompt
        ids = tokenize(tokenizer.encode, text)
        return p.TokenizeResponse(count=len(ids), tokens=ids,
                                  max_model_len=self.serving.engine_config.max_model_len), headers

    async def detokenize(self, request):
        """(DetokenizeResponse, headers) for a /detokenize body: the text of `tokens`."""
        body = _validate(p.DetokenizeRequest, await _json(request))
        headers = self._check(body)
        vocab = self.serving.engine_config.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: token id {bad[0]} is outside the vocabulary "
                                f"(0 to {vocab - 1})", param="tokens")
        # the text of exactly these tokens, special ones included (as vLLM's /detokenize)
        text = self.serving.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return p.DetokenizeResponse(prompt=text), headers

    def tokenizer_info(self):
        """The tokenizer's configuration, as vLLM's /tokenizer_info gives it."""
        tokenizer = self.serving.tokenizer
        special = getattr(tokenizer, "special_tokens", {}) or {}
        info = {"tokenizer_class": "PreTrainedTokenizerFast",
                **{key: special.get(key) for key in _SPECIAL_TOKENS},
                "chat_template": getattr(tokenizer, "chat_template", None),
                "model_max_length": self.serving.engine_config.max_model_len}
        return info


def openapi_body(*models):
    """The OpenAPI requestBody of a route that reads its JSON body itself (to tell a chat
    body from a prompt one): a JSON object of one of `models`, their schemas inlined, so
    that /openapi.json describes it as it does the routes that take a model."""
    schemas = [_inlined(m.model_json_schema()) for m in models]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _inlined(schema, defs=None):
    """`schema` with its `#/$defs/...` references replaced by what they name."""
    if defs is None:
        defs = schema.pop("$defs", {})
    if isinstance(schema, list):
        return [_inlined(item, defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref", "")
    if ref.startswith("#/$defs/"):
        return _inlined(dict(defs[ref[len("#/$defs/"):]]), defs)
    return {key: _inlined(value, defs) for key, value in schema.items()}


async def _json(request):
    body = await request.body()
    try:
        return json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def _validate(model, data):
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise RequestValidationError(e.errors()) from None
