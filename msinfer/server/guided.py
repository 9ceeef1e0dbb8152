"""What a request asks the grammar engine for (engine/structured.py), from any of the fields
clients send it in: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. At most one may be given; each is checked by compiling it now, so a schema
the engine cannot compile is a 400 naming the field."""
from ..engine.structured import check_spec, grammar_of, refuse

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def structured_outputs(body):
    """The structured_outputs dict of a request (None for free text); MsinferError with
    `.field` for a bad or ambiguous one."""
    found = []
    response_format = body.response_format
    if response_format is not None:
        found.append(("response_format", _from_response_format(response_format)))
    if body.structured_outputs is not None:
        check_spec(body.structured_outputs, "structured_outputs")
        found.append(("structured_outputs", body.structured_outputs))
    for field, kind in _GUIDED_FIELDS.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, {kind: value}))
    found = [(field, spec) for field, spec in found if spec is not None]
    if len(found) > 1:
        raise refuse(found[1][0], f"give one constraint on the output, not both "
                                  f"{found[0][0]} and {found[1][0]}")
    if not found:
        return None
    field, spec = found[0]
    grammar_of(spec, field)  # compiled now: a schema the engine refuses is this request's 400
    kind, value = check_spec(spec, field)
    return {kind: value}


def _from_response_format(response_format):
    field = "response_format"
    if not isinstance(response_format, dict):
        raise refuse(field, "must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise refuse(f"{field}.json_schema", "must be an object with a schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise refuse(f"{field}.json_schema.schema", "is missing")
        if not isinstance(schema, (dict, bool)):
            raise refuse(f"{field}.json_schema.schema", "must be a JSON schema (an object)")
        grammar_of({"json": schema}, f"{field}.json_schema.schema")
        return {"json": schema}
    raise refuse(f"{field}.type", f"{kind!r}: use 'text', 'json_object' or 'json_schema'")
