"""The OpenAPI document: the routes' request bodies described from protocol's models.

The routes read their bodies by hand (`serving.parse_body`: our own 400s, the arrival time taken
before parsing), so FastAPI cannot see them; without this the document would show every POST
as body-less, and clients, code generators and schemathesis would have nothing to go on.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


def describe_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` give each POST path in `bodies` its JSON body schema (required)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
                doc["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
