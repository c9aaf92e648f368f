"""What a request asks its answer to look like, as a small hashable value: it travels to every
rank with the request, and keys the cache of compiled grammars; and the limits a server puts on
compiling one."""

import json
from dataclasses import dataclass
from typing import Any, Optional

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call")


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; source: the schema as canonical JSON, the regex, the choices as a JSON
    list, the EBNF grammar, a tool call's schema and text around it (and the schema of the answer
    the model may give instead: tools.py), or empty for json_object."""

    kind: str
    source: str = ""

    @staticmethod
    def json_schema(schema: Any) -> "Constraint":
        return Constraint("json_schema", json.dumps(schema))

    @staticmethod
    def choice(choices: list[str]) -> "Constraint":
        return Constraint("choice", json.dumps(list(choices)))


@dataclass(frozen=True)
class GrammarLimits:
    """What the server compiles for a request: a constraint's source (the schema as JSON, the
    regex, the grammar, a forced tool call's schemas) of at most max_bytes, compiled within
    max_seconds (counted from the request's asking, so time queued behind other compiles counts)."""

    max_bytes: int = 65536
    max_seconds: float = 10.0


def from_response_format(response_format: Optional[dict]) -> Optional[Constraint]:
    """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", ...}) as a
    Constraint, or None for plain text. Raises ValueError on a shape it does not know."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError('json_schema must be an object {"name": ..., "schema": {...}}')
        return Constraint.json_schema(spec.get("schema", {}))
    raise ValueError(f'type must be "text", "json_object" or "json_schema", found {json.dumps(kind)}')
