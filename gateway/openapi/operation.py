"""One operation of the OpenAPI document (gateway/openapi.py assembles them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REF = "#/components/schemas/{name}"


@dataclass
class Operation:
    method: str
    path: str
    summary: str
    description: str
    request: type | None = None
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)  # media type -> schema, for 200
    errors: tuple[str, ...] = ("400", "404", "500", "503")
    example: dict[str, Any] | None = None
    ok_status: str = "200"
    tags: tuple[str, ...] = ()


def schema_ref(t: type) -> dict[str, Any]:
    return {"$ref": REF.format(name=t.__name__)}
