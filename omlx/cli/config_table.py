"""The README's configuration tables, generated from `omlx.config`'s fields.

A field's description is the one text of its documentation; its TOML key and environment
variable come from `omlx.config.setting_keys`, its ``omlx serve`` flag from `serve_flags`.
``python -m omlx.cli.config_table --write README.md`` rewrites the tables between the markers;
``tests/unit/test_config_docs.py`` fails when the README holds anything else there.

Must not: be imported by the server or by `omlx serve` (it reads `omlx serve`'s options through
`omlx.cli.serve.serve_flag_specs`; imports go one way).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from omlx.config import CONFIG_FILE_ENV, PROFILE_KEYS, ModelSettings, setting_keys
from omlx.cli.serve import serve_flag_specs
from omlx.config_values import bounds_of

BEGIN = "<!-- config tables: generated from omlx/config.py by `python -m omlx.cli.config_table --write README.md` -->"
END = "<!-- end of the generated config tables -->"
#: serve options that reach a key outside `serve_flags` (the secret goes through resolve_secret).
_OTHER_FLAGS = {"cluster.secret": "`--cluster-secret`"}


def serve_flag_of() -> dict[str, str]:
    """Config key -> the ``omlx serve`` option that sets it, as the table shows it."""
    out = dict(_OTHER_FLAGS)
    for key, (flag, repeats) in serve_flag_specs().items():
        out[key] = f"`{flag}`" + (" (repeatable)" if repeats else "")
    return out


def _default(name: str, value: Any) -> str:
    if value is None or value == () or value == {}:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if name.endswith("_bytes") and isinstance(value, int):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("GB", 10**9), ("MB", 10**6)):
            if value % size == 0:
                return f"`{value // size}{unit}`"
    if isinstance(value, tuple):
        value = ",".join(value)
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _meaning(info: FieldInfo) -> str:
    """The description, and the range a number key accepts (`omlx.config_values.Bounds`)."""
    bounds = bounds_of(info)
    text = info.description or ""
    if bounds is not None:
        text += f" ({bounds.words(integer='int' in str(info.annotation))})"
    return _cell(text)


def markdown() -> str:
    """Both tables (server keys, then ``[models."<id>"]`` keys) between `BEGIN` and `END`."""
    flags = serve_flag_of()
    rows = ["| TOML key | environment | `omlx serve` flag | default | meaning |", "|---|---|---|---|---|"]
    for key in setting_keys():
        toml = '[models."<id>"]' if key.name == "model_settings" else key.toml
        rows.append(f"| `{toml}` | {f'`{key.env}`' if key.env else ''} | {flags.get(key.name, '')} | "
                    f"{_default(key.name, key.info.get_default(call_default_factory=True))} | {_meaning(key.info)} |")
    rows.append(f"| | `{CONFIG_FILE_ENV}` | `--config` | `<base-path>/config.toml` | the TOML file of these keys |")
    model_rows = ['| `[models."<id>"]` key | default | in a profile | meaning |', "|---|---|---|---|"]
    for name, info in ModelSettings.model_fields.items():
        model_rows.append(f"| `{name}` | {_default(name, info.get_default(call_default_factory=True))} | "
                          f"{'yes' if name in PROFILE_KEYS else ''} | {_meaning(info)} |")
    return "\n".join([BEGIN, "", *rows, "", *model_rows, "", END])


def replace_in(text: str) -> str:
    """``text`` (the README) with its generated tables replaced by `markdown`'s."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + markdown() + text[end:]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"] and len(argv) == 2:
        path = Path(argv[1])
        path.write_text(replace_in(path.read_text()))
        return 0
    sys.stdout.write(markdown() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
