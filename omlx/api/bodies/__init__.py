"""Request models: one pydantic model per route body, validated once, documenting itself.

- `base`: `Body`, `parse_body` (bytes -> `Parsed`), the ValidationError -> 400 mapping;
- `openai`, `anthropic`, `responses`, `encoders`, `admin`: each protocol's models;
- `schema`: their JSON Schemas as OpenAPI components (`omlx.api.openapi` serves them).

Why pydantic (v2, a dependency already) and not msgspec: decoding and validating the recorded
65 KB Claude Code first turn (benchmarks/bench_request_overhead.py's body) as `MessagesRequest`
costs 0.083 ms with ``model_validate_json`` and 0.104 ms parsed once with pydantic-core's
``from_json`` and validated from the dict (what `parse_body` does, so the mapping reads the same
dicts), against 0.037 ms for an equivalent msgspec ``Struct`` decoder (stdlib ``json.loads``
alone: 0.121 ms); medians of 300 on the 2-core CPU dev machine, Python 3.11, pydantic 2.14.4,
msgspec 0.23.0, 2026-12-04. The 0.07 ms difference is under a tenth of the request's overhead (a
template render and its tokenization are 0.6 ms of it), and pydantic brings what msgspec lacks:
error locations with union arms and custom rules (``messages[3].content``), cross-field model
validators, JSON Schema 2020-12 for OpenAPI 3.1, and no new dependency.
"""

from omlx.api.bodies.base import Body, Parsed, parse_body

__all__ = ["Body", "Parsed", "parse_body"]
