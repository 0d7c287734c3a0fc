"""Every command of the CLI is listed in its group's ``--help`` (none hidden), with CliRunner."""

from __future__ import annotations

import re

import pytest
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner

from omlx.cli.main import app

runner = CliRunner()


def _groups(group: TyperGroup, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], TyperGroup]]:
    out = [(path, group)]
    for name, cmd in group.commands.items():
        if isinstance(cmd, TyperGroup):
            out += _groups(cmd, (*path, name))
    return out


ROOT = typer.main.get_command(app)
assert isinstance(ROOT, TyperGroup)
GROUPS = _groups(ROOT)


def test_the_cluster_group_is_walked() -> None:
    # The walk finds the sub-apps: `omlx cluster worker` (once hidden) is among what is checked.
    cluster = dict(GROUPS)[("cluster",)]
    assert {"join", "status", "plan", "leave", "worker"} <= set(cluster.commands)


@pytest.mark.parametrize("path, group", GROUPS, ids=lambda v: " ".join(("omlx", *v)) if isinstance(v, tuple) else "")
def test_help_lists_every_command(path: tuple[str, ...], group: TyperGroup) -> None:
    r = runner.invoke(app, [*path, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    listed = {m.group(1) for m in re.finditer(r"^[\s│|]*([a-z][a-z0-9-]*)\s", r.output, re.MULTILINE)}
    for name, cmd in group.commands.items():
        assert not cmd.hidden, f"`omlx {' '.join((*path, name))}` is hidden from --help"
        assert name in listed, f"`omlx {' '.join(path)} --help` does not list {name!r}:\n{r.output}"
