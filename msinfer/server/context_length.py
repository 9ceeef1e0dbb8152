"""A prompt too long for the model's context, refused as OpenAI and vLLM refuse it: a 400
whose error has `code: "context_length_exceeded"`, `param` naming the field that holds the
prompt (`messages` for chat, `prompt` for completions) and the wording client libraries match
on to trim a conversation and retry (LangChain, LlamaIndex, the agents built on them)."""
from .serving import ApiError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def check_context(prompt_tokens, max_tokens, max_model_len, field):
    """Refuse `prompt_tokens` + `max_tokens` beyond `max_model_len` (field: "messages" or
    "prompt", the request field that holds the prompt)."""
    requested = prompt_tokens + max_tokens
    if requested <= max_model_len:
        return
    raise ApiError(
        400, f"This model's maximum context length is {max_model_len} tokens. However, you "
             f"requested {requested} tokens ({prompt_tokens} in the messages, {max_tokens} in "
             f"the completion). Please reduce the length of the messages or completion.",
        param=field, code=CONTEXT_LENGTH_EXCEEDED)
