from pathlib import Path

import pytest

from omlx.config import load_config, parse_size
from omlx.errors import InvalidRequestError


def test_parse_size():
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size(1024) == 1024
    with pytest.raises(InvalidRequestError):
        parse_size("lots")


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path):
    f = tmp_path / "config.toml"
    f.write_text('port = 7001\nhost = "127.0.0.2"\nmax_concurrent_requests = 3\n[cache]\nblock_size = 64\n[aliases]\n"a" = "b"\n')
    cfg = load_config({}, {}, f)
    assert (cfg.port, cfg.host, cfg.max_concurrent_requests, cfg.cache.block_size) == (7001, "127.0.0.2", 3, 64)
    assert cfg.aliases == {"a": "b"}
    cfg = load_config({}, {"OMLX_PORT": "7002", "OMLX_BLOCK_SIZE": "32"}, f)
    assert (cfg.port, cfg.cache.block_size, cfg.host) == (7002, 32, "127.0.0.2")
    cfg = load_config({"port": 7003, "cache.block_size": 16}, {"OMLX_PORT": "7002"}, f)
    assert (cfg.port, cfg.cache.block_size) == (7003, 16)
    assert load_config({}, {}, None).port == 8000


def test_default_config_file_under_base_path(tmp_path: Path):
    (tmp_path / "config.toml").write_text("port = 7100\n")
    assert load_config({"base_path": str(tmp_path)}, {}).port == 7100


@pytest.mark.parametrize("text", ["bogus_key = 1\n", "port = 'abc'\n", "[cache]\nnope = 1\n", "port = \n"])
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(InvalidRequestError):
        load_config({}, {}, f)


def test_kv_bits_from_file_env_and_flags_and_bad_values_named(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("kv_bits = 8\nkv_group_size = 32\n")
    cfg = load_config({}, {}, f)
    assert (cfg.kv_bits, cfg.kv_group_size) == (8, 32)
    assert load_config({}, {"OMLX_KV_BITS": "4"}, f).kv_bits == 4
    assert load_config({"kv_bits": 6}, {"OMLX_KV_BITS": "4"}, f).kv_bits == 6
    assert load_config({}, {}, None).kv_bits is None
    for flags, word in (({"kv_bits": 7}, "kv_bits"), ({"kv_bits": 4, "kv_group_size": 48}, "kv_group_size")):
        with pytest.raises(InvalidRequestError, match=word):
            load_config(flags, {}, None)


def test_prefill_step_size_is_measured_by_default_pinned_by_any_source_and_a_block_multiple(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("prefill_step_size = 1024\n")
    assert load_config({}, {}, None).prefill_step_size is None
    assert load_config({}, {}, f).prefill_step_size == 1024
    assert load_config({}, {"OMLX_PREFILL_STEP_SIZE": "512"}, f).prefill_step_size == 512
    assert load_config({"prefill_step_size": 128, "cache.block_size": 64}, {}, f).prefill_step_size == 128
    for flags in ({"prefill_step_size": 300}, {"prefill_step_size": 128}, {"prefill_step_size": -256}):
        with pytest.raises(InvalidRequestError, match="prefill_step_size must be a positive multiple of block_size"):
            load_config(flags, {}, None)


def test_lookup_draft_tokens_is_off_by_default_set_by_any_source_and_bounded(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("lookup_draft_tokens = 4\n")
    assert load_config({}, {}, None).lookup_draft_tokens == 0
    assert load_config({}, {}, f).lookup_draft_tokens == 4
    assert load_config({}, {"OMLX_LOOKUP_DRAFT_TOKENS": "8"}, f).lookup_draft_tokens == 8
    assert load_config({"lookup_draft_tokens": 2}, {"OMLX_LOOKUP_DRAFT_TOKENS": "8"}, f).lookup_draft_tokens == 2
    for bad in (-1, 65):
        with pytest.raises(InvalidRequestError, match="lookup_draft_tokens must be 0"):
            load_config({"lookup_draft_tokens": bad}, {}, None)


def test_max_tpot_slowdown_defaults_to_2_is_set_by_any_source_and_checked(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("max_tpot_slowdown = 3.5\n")
    assert load_config({}, {}, None).max_tpot_slowdown == 2.0
    assert load_config({}, {}, f).max_tpot_slowdown == 3.5
    assert load_config({}, {"OMLX_MAX_TPOT_SLOWDOWN": "0"}, f).max_tpot_slowdown == 0.0
    assert load_config({"max_tpot_slowdown": 1.5}, {"OMLX_MAX_TPOT_SLOWDOWN": "0"}, f).max_tpot_slowdown == 1.5
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(InvalidRequestError, match="max_tpot_slowdown must be a number >= 0"):
            load_config({"max_tpot_slowdown": bad}, {}, None)
    with pytest.raises(InvalidRequestError, match="bad value for max_tpot_slowdown.*from environment variable OMLX_MAX_TPOT_SLOWDOWN$"):
        load_config({}, {"OMLX_MAX_TPOT_SLOWDOWN": "fast"}, None)
    f.write_text("max_tpot_slowdown = true\n")  # would be 1.0, pacing off, silently
    with pytest.raises(InvalidRequestError, match=f"bad value for max_tpot_slowdown: True.*from config file {f}$"):
        load_config({}, {}, f)
    with pytest.raises(InvalidRequestError, match="bad value for max_tpot_slowdown: 'x'.*from the command line$"):
        load_config({"max_tpot_slowdown": "x"}, {"OMLX_MAX_TPOT_SLOWDOWN": "fast"}, f)


def test_test_park_comes_from_the_environment_only_and_is_off_by_default():
    assert load_config(env={}).test_park is False
    assert load_config(env={"OMLX_TEST_PARK": "1"}).test_park is True
