"""`omlx bench` as a subprocess against real omlx servers, with tiny workloads: valid JSON with
every figure, `--compare` against a second omlx on another port, the `--min-ratio` exit code,
and the `restart` scenario on a server it starts itself (the SSD tier brings the prompt back)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import MODEL_ID, TEST_HOME, ServerProcess, running

TINY = ["--max-tokens", "4", "--reply-tokens", "2", "--prompt-tokens", "96", "--concurrency", "1,2",
        "--agent-turns", "2", "--tool-result-tokens", "24"]
SPREAD = ("median", "min", "max", "n")


@pytest.fixture(scope="module")
def servers():
    with running(ServerProcess(["--block-size", "16", "--no-ssd-cache"]),
                 ServerProcess(["--block-size", "16", "--no-ssd-cache"])) as pair:
        yield pair


def bench(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omlx", "bench", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def test_every_scenario_gives_every_figure(servers, tmp_path):
    a, _ = servers
    out = tmp_path / "bench.json"
    p = bench("decode", "concurrency", "cache", "agent", "edit", "restart", "--base-url", a.url, "--repeat", "2",
              "--json", str(out), *TINY)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""  # the JSON went to the file; the table to stderr
    assert "TTFT" in p.stderr
    r = json.loads(out.read_text())
    assert r["targets"]["base"]["model"] == MODEL_ID
    assert r["config"]["token_counter"] == "server" and r["num_errors"] == 0
    steps = {sc: list(v) for sc, v in r["scenarios"].items()}
    assert steps == {"decode": ["decode"], "concurrency": ["c1", "c2"],
                     "cache": ["cold", "identical", "suffix", "middle_edit"], "agent": ["turn-1", "turn-2-edit"],
                     "edit": ["edit"], "restart": ["cold", "after_restart"]}
    for sc in ("decode", "concurrency", "cache", "agent", "edit"):
        for step, entry in r["scenarios"][sc].items():
            figs = entry["base"]["figures"]
            assert set(figs) == set(r["figures"])
            for f in ("ttft_s", "tpot_s", "decode_tps", "aggregate_tps", "prompt_tokens", "cached_tokens",
                      "peak_memory_bytes"):
                s = figs[f]
                assert set(s) == set(SPREAD) and s["n"] == 2, (sc, step, f, s)
                assert 0 <= s["min"] <= s["median"] <= s["max"], (sc, step, f, s)
            assert figs["ttft_s"]["min"] > 0 and figs["peak_memory_bytes"]["min"] > 0
    cache = r["scenarios"]["cache"]
    cold, same = cache["cold"]["base"]["figures"], cache["identical"]["base"]["figures"]
    assert same["cached_tokens"]["min"] >= same["prompt_tokens"]["max"] - 16  # all full blocks hit
    assert cold["cached_tokens"]["max"] < same["cached_tokens"]["min"]
    edit = cache["middle_edit"]["base"]["figures"]["cached_tokens"]
    assert 0 < edit["median"] < same["cached_tokens"]["median"]  # the edit cuts the hit in the middle
    c2 = [row for row in r["runs"] if row["scenario"] == "concurrency" and row["step"] == "c2"]
    assert all(row["num_requests"] == 2 for row in c2)
    restart = r["scenarios"]["restart"]["after_restart"]["base"]
    assert "--serve" in restart["skipped"]  # not an omlx this run started


def test_compare_prints_ratios_and_min_ratio_sets_the_exit_code(servers):
    a, b = servers
    tok = str(TEST_HOME / "models" / MODEL_ID)
    p = bench("decode", "--base-url", a.url, "--compare", b.url, "--repeat", "1", "--tokenizer", tok,
              "--min-ratio", "1000", *TINY)
    assert p.returncode == 1, p.stderr
    r = json.loads(p.stdout)
    assert set(r["targets"]) == {"base", "compare"} and r["targets"]["compare"]["url"] == b.url
    assert r["config"]["token_counter"] == "tokenizer"
    ratio = r["scenarios"]["decode"]["decode"]["ratio"]
    assert ratio["ttft_s"] > 0 and ratio["decode_tps"] > 0
    assert r["min_ratio"] == {"min": 1000.0, "passed": False, "below": ["ttft_s", "tpot_s", "decode_tps", "aggregate_tps"]}
    assert "below --min-ratio" in p.stderr and "ratio" in p.stderr
    runs = [(row["target"], row["step"]) for row in r["runs"]]
    assert runs == [("base", "decode"), ("compare", "decode")]

    p = bench("decode", "--base-url", a.url, "--compare", b.url, "--repeat", "1", "--min-ratio", "0.001", "-q", *TINY)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["min_ratio"]["passed"] is True


def test_bad_invocations_exit_2_with_the_reason(servers):
    a, _ = servers
    p = bench("decode", "--base-url", "http://127.0.0.1:9", "-q")
    assert p.returncode == 2 and "cannot be reached" in p.stderr
    p = bench("decode", "--base-url", a.url, "--min-ratio", "1", "-q")
    assert p.returncode == 2 and "--compare" in p.stderr
    p = bench("nonsense", "--base-url", a.url, "-q")
    assert p.returncode == 2 and "unknown scenario" in p.stderr
    p = bench("decode", "--base-url", a.url, "--concurrency", "0,x", "-q")
    assert p.returncode == 2 and "--concurrency" in p.stderr


def test_restart_replays_from_the_ssd_tier(tmp_path):
    (tmp_path / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    p = bench("restart", "--serve", "--serve-args", f"--base-path {tmp_path} --block-size 16 --ssd-cache-max-size 64MB",
              "--repeat", "1", "-q", *TINY)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["config"]["managed_server"] is True
    steps = r["scenarios"]["restart"]
    cold, after = steps["cold"]["base"]["figures"], steps["after_restart"]["base"]["figures"]
    # at most the chat template prefix the warm-up chat shares (its blocks and, reused in part
    # like the hot tier does, its next block from disk): well short of the ~96-token prompt
    assert cold["cached_tokens"]["median"] <= 32
    assert after["cached_tokens"]["median"] >= after["prompt_tokens"]["median"] - 16  # back from SSD
    assert after["restart_s"]["median"] > 0
