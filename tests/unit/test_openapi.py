"""The served OpenAPI document lists exactly the routes the Sanic app registers."""

from __future__ import annotations

import json
import re

from omlx.api.app import create_app
from omlx.api.openapi import openapi_document
from omlx.config import ServerConfig


def _app_routes() -> dict[str, set[str]]:
    # create_app only registers routes and stores the pool; no model is needed to list them
    app = create_app(ServerConfig(), pool=None, status={}, name="omlx_openapi_test")
    out: dict[str, set[str]] = {}
    for route in app.router.routes:
        path = "/" + route.path.lstrip("/")
        path = re.sub(r"<(\w+)(:[^>]*)?>", r"{\1}", path)
        out.setdefault(path, set()).update(m.lower() for m in route.methods)
    return out


def test_every_registered_route_is_documented_with_its_methods():
    doc = openapi_document()
    routes = _app_routes()
    documented = {p: {m for m in ops if m in ("get", "head", "post", "put", "delete", "patch")} for p, ops in doc["paths"].items()}
    assert set(routes) == set(documented), (set(routes) ^ set(documented))
    for path, methods in routes.items():
        assert methods == documented[path], (path, methods, documented[path])


def test_every_schema_reference_resolves_and_the_document_is_json():
    doc = openapi_document("http://127.0.0.1:8000")
    text = json.dumps(doc)
    for name in re.findall(r'"#/components/schemas/(\w+)"', text):
        assert name in doc["components"]["schemas"], name
    assert doc["openapi"].startswith("3.1") and doc["servers"][0]["url"] == "http://127.0.0.1:8000"


def test_every_operation_documents_its_error_shape():
    for path, ops in openapi_document()["paths"].items():
        for method, op in ops.items():
            assert "4XX" in op["responses"] and {"200", "202"} & set(op["responses"]), (path, method)
            schema = op["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"]
            assert schema.endswith("AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"), (path, schema)


def test_the_document_is_valid_openapi_3_1():
    from openapi_spec_validator import validate

    validate(openapi_document("http://127.0.0.1:8000"))  # raises naming the first schema at fault


def _schemas_in(node, where=""):
    if isinstance(node, dict):
        yield where, node
        for k, v in node.items():
            yield from _schemas_in(v, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _schemas_in(v, f"{where}/{i}")


def _allows_null(schema: dict, components: dict) -> bool:
    if "$ref" in schema:
        return _allows_null(components[schema["$ref"].rsplit("/", 1)[1]], components)
    if "anyOf" in schema or "oneOf" in schema:
        return any(_allows_null(a, components) for a in schema.get("anyOf", schema.get("oneOf")))
    t = schema.get("type")
    return ("const" not in schema and "enum" not in schema and (t is None or t == "null" or (isinstance(t, list) and "null" in t))
            or schema.get("const", 0) is None or None in schema.get("enum", ()))


def test_every_null_default_is_a_value_its_schema_allows():
    # a field that defaults to None accepts an explicit null (the models take it), so its schema says so
    components = openapi_document()["components"]["schemas"]
    wrong = [where for where, s in _schemas_in(components) if "default" in s and s["default"] is None
             and not _allows_null(s, components)]
    assert not wrong, wrong
