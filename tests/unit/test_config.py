import json
from pathlib import Path

import pytest

from omlx.config import ServerConfig, SettingKey, load_config, parse_size, setting_keys
from omlx.errors import ConfigError, InvalidRequestError


def test_parse_size():
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size(1024) == 1024
    with pytest.raises(ValueError, match="not a byte size"):
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
    with pytest.raises(ConfigError):
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
        with pytest.raises(ConfigError, match=word):
            load_config(flags, {}, None)


def test_prefill_step_size_is_measured_by_default_pinned_by_any_source_and_a_block_multiple(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("prefill_step_size = 1024\n")
    assert load_config({}, {}, None).prefill_step_size is None
    assert load_config({}, {}, f).prefill_step_size == 1024
    assert load_config({}, {"OMLX_PREFILL_STEP_SIZE": "512"}, f).prefill_step_size == 512
    assert load_config({"prefill_step_size": 128, "cache.block_size": 64}, {}, f).prefill_step_size == 128
    for flags in ({"prefill_step_size": 300}, {"prefill_step_size": 128}, {"prefill_step_size": -256}):
        with pytest.raises(ConfigError, match="prefill_step_size must be a positive multiple of block_size"):
            load_config(flags, {}, None)


def test_lookup_draft_tokens_is_off_by_default_set_by_any_source_and_bounded(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("lookup_draft_tokens = 4\n")
    assert load_config({}, {}, None).lookup_draft_tokens == 0
    assert load_config({}, {}, f).lookup_draft_tokens == 4
    assert load_config({}, {"OMLX_LOOKUP_DRAFT_TOKENS": "8"}, f).lookup_draft_tokens == 8
    assert load_config({"lookup_draft_tokens": 2}, {"OMLX_LOOKUP_DRAFT_TOKENS": "8"}, f).lookup_draft_tokens == 2
    for bad in (-1, 65):
        with pytest.raises(ConfigError, match="lookup_draft_tokens must be 0"):
            load_config({"lookup_draft_tokens": bad}, {}, None)


def test_max_tpot_slowdown_defaults_to_2_is_set_by_any_source_and_checked(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("max_tpot_slowdown = 3.5\n")
    assert load_config({}, {}, None).max_tpot_slowdown == 2.0
    assert load_config({}, {}, f).max_tpot_slowdown == 3.5
    assert load_config({}, {"OMLX_MAX_TPOT_SLOWDOWN": "0"}, f).max_tpot_slowdown == 0.0
    assert load_config({"max_tpot_slowdown": 1.5}, {"OMLX_MAX_TPOT_SLOWDOWN": "0"}, f).max_tpot_slowdown == 1.5
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="max_tpot_slowdown must be a number >= 0"):
            load_config({"max_tpot_slowdown": bad}, {}, None)
    with pytest.raises(ConfigError, match="bad value for max_tpot_slowdown.*from environment variable OMLX_MAX_TPOT_SLOWDOWN$"):
        load_config({}, {"OMLX_MAX_TPOT_SLOWDOWN": "fast"}, None)
    f.write_text("max_tpot_slowdown = true\n")  # would be 1.0, pacing off, silently
    with pytest.raises(ConfigError, match=f"bad value for max_tpot_slowdown: True.*from config file {f}$"):
        load_config({}, {}, f)
    with pytest.raises(ConfigError, match="bad value for max_tpot_slowdown: 'x'.*from the command line$"):
        load_config({"max_tpot_slowdown": "x"}, {"OMLX_MAX_TPOT_SLOWDOWN": "fast"}, f)


def test_test_park_comes_from_the_environment_only_and_is_off_by_default():
    assert load_config(env={}).test_park is False
    assert load_config(env={"OMLX_TEST_PARK": "1"}).test_park is True


# ---- every key, every source (generated from the model: omlx.config.setting_keys) ------------


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _toml(path: tuple[str, ...], value: object) -> str:
    """A TOML file setting the key at ``path`` (the file's own key names, `SettingKey.toml`)."""
    *table, name = path
    head = f"[{'.'.join(table)}]\n" if table else ""
    if isinstance(value, dict):  # a table of its own: [aliases], [models."<id>"]
        if all(isinstance(v, dict) for v in value.values()):
            return "".join(f'[{name}."{k}"]\n' + "".join(f"{kk} = {_toml_value(vv)}\n" for kk, vv in v.items())
                           for k, v in value.items())
        return f"[{'.'.join([*table, name])}]\n" + "".join(f'"{k}" = {_toml_value(v)}\n' for k, v in value.items())
    return f"{head}{name} = {_toml_value(value)}\n"


def _env_value(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(value)
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _expected(key: SettingKey) -> object:
    """The attribute the key's example gives, built without any source."""
    example = key.info.examples[0]
    nested: dict = {}
    tree = nested
    for p in key.path[:-1]:
        tree = tree.setdefault(p, {})
    tree[key.path[-1]] = example
    value = ServerConfig(**nested)
    for p in key.path:
        value = getattr(value, p)
    return value


KEYS = list(setting_keys())
CASES = [(k, s) for k in KEYS for s in k.sources]


def test_every_key_is_documented_with_an_example_that_is_not_its_default():
    for key in KEYS:
        assert key.info.description, f"{key.name} has no description (the README table is made of them)"
        assert key.info.examples, f"{key.name} has no example"
        assert _expected(key) != key.info.get_default(call_default_factory=True), f"{key.name}: the example is the default"
    envs = [k.env for k in KEYS if k.env]
    assert len(envs) == len(set(envs)) and all(e.startswith("OMLX_") for e in envs)
    assert len({k.toml for k in KEYS}) == len(KEYS)


@pytest.mark.parametrize("key, source", CASES, ids=[f"{k.name}-{s}" for k, s in CASES])
def test_every_key_is_set_by_file_env_and_flag(tmp_path: Path, key: SettingKey, source: str):
    example, want = key.info.examples[0], _expected(key)
    f = tmp_path / "c.toml"
    f.write_text("")
    if source == "file":
        f.write_text(_toml(tuple(key.toml.split(".")), example))
        cfg = load_config({}, {}, f)
    elif source == "env":
        cfg = load_config({}, {key.env: _env_value(example)}, f)
    else:
        cfg = load_config({key.name: example}, {}, f)
    got = cfg
    for p in key.path:
        got = getattr(got, p)
    assert got == want
    # and it is the source that wins over the ones below it
    if source != "file" and "file" in key.sources:
        f.write_text(_toml(tuple(key.toml.split(".")), key.info.get_default(call_default_factory=True) or example))
        again = load_config({key.name: example} if source == "flags" else {},
                            {key.env: _env_value(example)} if source == "env" else {}, f)
        for p in key.path:
            again = getattr(again, p)
        assert again == want


def _bad_value(key: SettingKey, source: str) -> tuple[object, str] | None:
    """A value of the wrong type for ``key`` from ``source`` and the words the error must hold;
    None where the source cannot carry a wrong type (an env string is a valid string)."""
    ann = str(key.info.annotation)
    if key.path[-1].endswith("_bytes"):
        return "lots", "not a byte size"
    if ann.startswith("<class 'bool'>") or ann == "bool | None":
        return "maybe", "expected true or false"
    if "int" in ann:
        return "abc", "expected an integer"
    if "float" in ann:
        return "abc", "expected a number"
    if source == "env":
        return ("a=b,c", "expected NAME=TARGET") if "Mapping" in ann else None
    if "tuple" in ann:
        return 5, "expected a list"
    if "ModelSettings" in ann:  # `models = 5` in a file would be the list of models to load
        return {"m": 5}, "expected a table"
    if "Mapping" in ann:
        return 5, "expected a table"
    return 5, "expected a string"


BAD = [(k, s) for k, s in CASES if _bad_value(k, s) is not None]


@pytest.mark.parametrize("key, source", BAD, ids=[f"{k.name}-{s}" for k, s in BAD])
def test_a_bad_type_in_any_source_is_a_config_error_naming_source_key_and_type(tmp_path: Path, key: SettingKey,
                                                                                source: str):
    bad, words = _bad_value(key, source)
    f = tmp_path / "c.toml"
    f.write_text("")
    if source == "file":
        f.write_text(_toml(tuple(key.toml.split(".")), bad))
        name, origin = key.toml, f"config file {f}"
    elif source == "env":
        name, origin = key.name, f"environment variable {key.env}"
    else:
        name, origin = key.name, "the command line"
    with pytest.raises(ConfigError) as err:
        load_config({key.name: bad} if source == "flags" else {}, {key.env: str(bad)} if source == "env" else {}, f)
    msg = err.value.message
    assert msg.startswith(f"bad value for {name}"), msg
    assert words in msg and msg.endswith(f"from {origin}"), msg
    assert not isinstance(err.value, InvalidRequestError)  # a startup error, not an HTTP 400


def test_env_only_keys_are_refused_from_the_file_and_the_command_line(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("test_park = true\n")
    with pytest.raises(ConfigError, match=f"test_park cannot be set in config file {f}: only by environment variable OMLX_TEST_PARK"):
        load_config({}, {}, f)
    with pytest.raises(ConfigError, match="test_fault cannot be set on the command line"):
        load_config({"test_fault": "forward:seed=1"}, {}, None)


def test_a_cross_key_check_names_the_key_a_source_set(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"bad value for cluster.heartbeat_timeout_s: '0.5' \(cluster heartbeat_interval_s "
                                          r"must be > 0 and below heartbeat_timeout_s\), from environment variable "
                                          r"OMLX_CLUSTER_HEARTBEAT_TIMEOUT_S$"):
        load_config({}, {"OMLX_CLUSTER_HEARTBEAT_TIMEOUT_S": "0.5"}, None)
    f = tmp_path / "c.toml"
    f.write_text("[cache]\nhot_cache_max_size = '1GB'\n")
    assert load_config({"cache.hot_cache_max_bytes": "2GB"}, {}, f).cache.hot_cache_max_bytes == 2 * 10**9
    f.write_text("[memory]\nceiling_bytes = '1GB'\n")  # the attribute's own name is read too
    assert load_config({}, {}, f).memory.ceiling_bytes == 10**9


def test_a_missing_or_unreadable_config_file_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read config file .*: no such file"):
        load_config({}, {}, tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config({}, {"OMLX_CONFIG": str(tmp_path)}, None)


def test_server_config_built_directly_reads_no_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMLX_PORT", "7777")
    assert ServerConfig().port == 8000
    assert load_config({}, None, None).port == 7777


def test_the_config_and_its_sections_are_frozen():
    from pydantic import ValidationError

    cfg = load_config({}, {}, None)
    for obj, name in ((cfg, "port"), (cfg.cache, "block_size"), (cfg.memory, "ceiling_bytes"),
                      (cfg.cluster, "secret")):
        with pytest.raises(ValidationError, match="frozen"):
            setattr(obj, name, 1)
