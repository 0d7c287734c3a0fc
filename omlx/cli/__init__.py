"""The `omlx` command line: one Typer sub-app per noun."""
