"""`python -m omlx` runs the CLI."""

from omlx.cli.main import app

app()
