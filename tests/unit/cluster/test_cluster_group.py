"""Pieces of the pipeline that run without peers: range parsing, the hostfile, the watchdog, and
the stage wrapper itself on a single rank (it must reproduce the full model's logits)."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from omlx.cluster.group import Watchdog, read_hostfile, write_hostfile
from omlx.cluster.pipeline import LayerRange, parse_ranges
from omlx.errors import ClusterUnavailableError


def test_parse_ranges_accepts_contiguous_ranges_from_zero():
    assert parse_ranges("0:15,15:30") == [LayerRange(0, 15), LayerRange(15, 30)]
    assert parse_ranges(" 0:3 , 3:4 ,4:30") == [LayerRange(0, 3), LayerRange(3, 4), LayerRange(4, 30)]


@pytest.mark.parametrize("text, words", [
    ("1:15,15:30", "start at layer 0"),
    ("0:15,16:30", "start at layer 15"),
    ("0:15,15:15", "empty"),
    ("0-15", "START:END"),
    ("0:a", "integers"),
])
def test_parse_ranges_names_the_bad_part(text, words):
    with pytest.raises(ValueError, match=words):
        parse_ranges(text)


def test_hostfile_round_trips_in_mlx_launch_format(tmp_path):
    path = write_hostfile(tmp_path / "h.json", [("127.0.0.1", 5000), ("10.0.0.2", 5001)])
    assert path.read_text() == '[["127.0.0.1:5000"], ["10.0.0.2:5001"]]'
    assert read_hostfile(path) == [["127.0.0.1:5000"], ["10.0.0.2:5001"]]
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="list of lists"):
        read_hostfile(tmp_path / "bad.json")


def test_watchdog_reports_a_stuck_step_once_and_ignores_quick_ones():
    fired: list[ClusterUnavailableError] = []
    done = threading.Event()
    dog = Watchdog(0.3, lambda e: (fired.append(e), done.set()), rank=2)
    for _ in range(3):
        with dog.step("quick"):
            time.sleep(0.01)
    time.sleep(0.5)
    assert fired == []
    with dog.step("decode step"):
        assert done.wait(5)
    assert len(fired) == 1 and dog.fired
    assert "rank 2: decode step did not complete within 0 s" in fired[0].message
    assert fired[0].status == 503


def test_single_rank_stage_reproduces_the_full_model():
    """A 1-rank 'pipeline' (no peers) must give the mlx-lm model's own last-position logits."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from omlx.cluster.pipeline import load_stage
    from tests.helpers import default_model_dir

    path = default_model_dir()
    group = mx.distributed.init()  # size 1 without a hostfile
    stage, _ = load_stage(path, LayerRange(0, 30), group)
    stage.configure([stage.local_facts()])
    full, _ = load_model(path)
    ids = mx.array([[1, 504, 3458, 282, 4649, 314, 2]])
    want = full(ids, cache=make_prompt_cache(full))[:, -1:, :]
    got = stage(ids, cache=stage.make_cache())
    assert got.shape == want.shape == (1, 1, 49152)
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("argv, words", [
    (["--ranges", "0:15,16:30", "--rank", "0"], "must start at layer 15"),
    (["--ranges", "0:15,15:30", "--rank", "2"], "outside the 2 ranges"),
])
def test_worker_command_refuses_bad_ranges_with_exit_2(tmp_path, argv, words):
    from typer.testing import CliRunner

    from omlx.cli.cluster_worker import worker_app

    r = CliRunner().invoke(worker_app, ["--model", str(tmp_path), "--hostfile", str(tmp_path / "h.json"), *argv])
    assert r.exit_code == 2
    assert words in r.output
