"""Request models: one pydantic model per route body, validated once, documenting itself.

- `base`: `Body`, `parse_body` (bytes -> `Parsed`), the ValidationError -> 400 mapping;
- `openai`, `anthropic`, `responses`, `encoders`, `admin`: each protocol's models;
- `schema`: their JSON Schemas as OpenAPI components (`omlx.api.openapi` serves them).

Why pydantic (v2, a dependency already) and not msgspec, measured by benchmarks/bench_body_decode.py
on the recorded 65 KB Claude Code first turn (medians of 300, 2-core shared CPU, Python 3.11,
pydantic 2.14.4, msgspec 0.23.0, 2026-12-04; two runs):

    stdlib json.loads, no validation                      0.072 / 0.121 ms
    pydantic MessagesRequest.model_validate_json          0.073 / 0.083 ms
    pydantic from_json + model_validate (parse_body)      0.066 / 0.104 ms
    msgspec Struct decode + validate (same fields)        0.035 / 0.037 ms

msgspec is about 2x faster, but the 0.03-0.07 ms it would save is under a tenth of what the
request costs before the engine admits it (0.7 ms, of which the chat template and the tokenizer
take 0.5-0.6 ms: benchmarks/bench_request_overhead.py), and pydantic is already a dependency and
brings what the contract needs: error locations through unions and custom rules
(``messages[3].content``), cross-field model validators, and JSON Schema 2020-12 for OpenAPI 3.1.
`parse_body` parses with pydantic-core's ``from_json`` and validates the dict, so the protocol
mapping reads the same dicts the model checked (no second parse, no dump back to dicts).
"""

from omlx.api.bodies.base import Body, Parsed, parse_body

__all__ = ["Body", "Parsed", "parse_body"]
