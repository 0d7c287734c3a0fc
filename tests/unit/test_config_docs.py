"""The README's configuration tables are generated from omlx/config.py's fields and list every
``OMLX_*`` variable omlx reads, so a new setting cannot go undocumented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from omlx.cli.config_table import BEGIN, END, markdown, replace_in
from omlx.config import CONFIG_FILE_ENV, setting_keys

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
#: OMLX_* names in omlx/ that are not settings, and why.
NOT_SETTINGS = {
    "OMLX_BLAS_REEXEC": "a marker the BLAS re-exec sets for its own child (omlx.cli.common)",
    "OMLX_LAUNCH_API_KEY": "what `omlx launch codex` hands Codex as its env_key; Codex reads it",
    "OMLX_HOME": "a constant of omlx.engine.catalogue (a model's source), not a variable",
}
_NAME = re.compile(r"\bOMLX_(?:[A-Z0-9]+_)*[A-Z0-9]+\b")


def _table() -> str:
    return README[README.index(BEGIN):README.index(END)]


def test_readme_tables_are_the_generated_ones():
    assert replace_in(README) == README, (
        "README.md's configuration tables differ from omlx/config.py's fields: run "
        "`python -m omlx.cli.config_table --write README.md`")


def test_every_setting_is_a_row_with_its_toml_key_env_and_description():
    table = _table()
    for key in setting_keys():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{key.toml}` ")
                    or (key.name == "model_settings" and line.startswith('| `[models."<id>"]` |'))), None)
        assert row is not None, f"{key.name} has no row"
        assert (key.env is None or f"`{key.env}`" in row) and " ".join(key.info.description.split()) in row.replace("\\|", "|")


def test_every_omlx_variable_in_the_code_is_in_the_table():
    table = _table()
    seen: dict[str, str] = {}
    for path in sorted((ROOT / "omlx").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in _NAME.findall(node.value):
                    seen.setdefault(name, str(path.relative_to(ROOT)))
    assert CONFIG_FILE_ENV in seen and "OMLX_TEST_FAULT" in seen  # the scan sees what it should
    missing = {n: where for n, where in seen.items() if f"`{n}`" not in table and n not in NOT_SETTINGS}
    assert not missing, f"OMLX_* variables read in omlx/ but missing from README's configuration table: {missing}"
    for name in ("OMLX_MAX_BODY_BYTES", "OMLX_KEEPALIVE_S", "OMLX_DISABLE_KERNELS", "OMLX_STRICT_CONTENT"):
        assert f"`{name}`" in table


def test_the_generated_table_changes_with_a_description(monkeypatch):
    from omlx.config import ServerConfig

    monkeypatch.setattr(ServerConfig.model_fields["port"], "description", "a changed description")
    assert "a changed description" in markdown() and replace_in(README) != README
