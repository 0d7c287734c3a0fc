"""README's `omlx` on the PATH: from a fresh shell (bare PATH, no profile) `omlx` is not found
until the venv is activated or its script is linked into a PATH folder; then README's `omlx ...`
commands run as written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO

VENV = REPO / ".venv"


def _fresh_shell(script: str, home: Path, path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess:
    # PYTHONPATH only matters for a git worktree sharing another checkout's editable venv: the
    # package then comes from this tree, as it does after setup.sh in a checkout of its own
    env = {"HOME": str(home), "PATH": path, "LANG": "C.UTF-8", "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    return subprocess.run(["bash", "--noprofile", "--norc", "-c", script], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(not (VENV / "bin" / "omlx").exists(), reason="no .venv/bin/omlx: run ./scripts/setup.sh")
def test_omlx_is_found_after_the_readme_steps(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    r = _fresh_shell("omlx --help", home)
    assert r.returncode == 127 and "omlx: command not found" in r.stderr  # the problem README answers
    readme = (REPO / "README.md").read_text()
    assert "source .venv/bin/activate" in readme and 'ln -s "$PWD/.venv/bin/omlx" ~/.local/bin/omlx' in readme
    r = _fresh_shell("source .venv/bin/activate && omlx models list --base-path ~/.omlx --hub-cache-dir ~/hub "
                     "&& omlx doctor --help >/dev/null && omlx models pull --help", home)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no models in" in r.stdout and "ORG/NAME" in r.stdout
    (home / ".local" / "bin").mkdir(parents=True)
    r = _fresh_shell('ln -s "$PWD/.venv/bin/omlx" ~/.local/bin/omlx && omlx models list --base-path ~/.omlx '
                     "--hub-cache-dir ~/hub", home, path=f"{home}/.local/bin:/usr/bin:/bin")
    assert r.returncode == 0 and "no models in" in r.stdout, r.stdout + r.stderr
