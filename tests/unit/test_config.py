import json
from pathlib import Path

import pytest

from omlx.config import ServerConfig, SettingKey, load_config, setting_keys
from omlx.config_values import parse_size
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
    for flags in ({"prefill_step_size": 300}, {"prefill_step_size": 128}):
        with pytest.raises(ConfigError, match="prefill_step_size must be a positive multiple of block_size"):
            load_config(flags, {}, None)
    with pytest.raises(ConfigError, match=r"bad value for --prefill-step-size: -256 \(expected an integer >= 1\)"):
        load_config({"prefill_step_size": -256}, {}, None)


def test_lookup_draft_tokens_is_off_by_default_set_by_any_source_and_bounded(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("lookup_draft_tokens = 4\n")
    assert load_config({}, {}, None).lookup_draft_tokens == 0
    assert load_config({}, {}, f).lookup_draft_tokens == 4
    assert load_config({}, {"OMLX_LOOKUP_DRAFT_TOKENS": "8"}, f).lookup_draft_tokens == 8
    assert load_config({"lookup_draft_tokens": 2}, {"OMLX_LOOKUP_DRAFT_TOKENS": "8"}, f).lookup_draft_tokens == 2
    for bad in (-1, 65):
        with pytest.raises(ConfigError, match=rf"--lookup-draft-tokens: {bad} \(expected an integer from 0 to 64\)"):
            load_config({"lookup_draft_tokens": bad}, {}, None)


def test_max_tpot_slowdown_defaults_to_2_is_set_by_any_source_and_checked(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("max_tpot_slowdown = 3.5\n")
    assert load_config({}, {}, None).max_tpot_slowdown == 2.0
    assert load_config({}, {}, f).max_tpot_slowdown == 3.5
    assert load_config({}, {"OMLX_MAX_TPOT_SLOWDOWN": "0"}, f).max_tpot_slowdown == 0.0
    assert load_config({"max_tpot_slowdown": 1.5}, {"OMLX_MAX_TPOT_SLOWDOWN": "0"}, f).max_tpot_slowdown == 1.5
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"--max-tpot-slowdown: .* \(expected a number >= 0\)"):
            load_config({"max_tpot_slowdown": bad}, {}, None)
    with pytest.raises(ConfigError, match="bad value for OMLX_MAX_TPOT_SLOWDOWN: 'fast' .*from the environment$"):
        load_config({}, {"OMLX_MAX_TPOT_SLOWDOWN": "fast"}, None)
    f.write_text("max_tpot_slowdown = true\n")  # would be 1.0, pacing off, silently
    with pytest.raises(ConfigError, match=f"bad value for max_tpot_slowdown: True.*from config file {f}$"):
        load_config({}, {}, f)
    with pytest.raises(ConfigError, match=f"bad value for --max-tpot-slowdown: 'x'.*from the command line; "
                                          f"bad value for max_tpot_slowdown: True.*from config file {f}$"):
        load_config({"max_tpot_slowdown": "x"}, {"OMLX_MAX_TPOT_SLOWDOWN": "2"}, f)


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
    elif source == "env":  # the variable and the flag the user wrote, never the attribute's name
        name, origin = key.env, "the environment"
    else:
        name, origin = "--" + key.path[-1].replace("_", "-"), "the command line"
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
    with pytest.raises(ConfigError, match=r"bad value for OMLX_CLUSTER_HEARTBEAT_TIMEOUT_S: '0.5' \(cluster heartbeat_interval_s "
                                          r"must be below heartbeat_timeout_s\), from the environment$"):
        load_config({}, {"OMLX_CLUSTER_HEARTBEAT_TIMEOUT_S": "0.5"}, None)
    f = tmp_path / "c.toml"
    f.write_text("[cache]\nhot_cache_max_size = '1GB'\n")
    assert load_config({"cache.hot_cache_max_bytes": "2GB"}, {}, f).cache.hot_cache_max_bytes == 2 * 10**9
    f.write_text("[memory]\nceiling_bytes = '1GB'\n")  # the attribute's own name is read too
    assert load_config({}, {}, f).memory.ceiling_bytes == 10**9


def test_a_missing_or_unreadable_config_file_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read config file .*: no such file"):
        load_config({}, {}, tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cannot read config file .*: it is a directory"):
        load_config({}, {"OMLX_CONFIG": str(tmp_path)}, None)


@pytest.mark.parametrize("text, want", [
    ("prot = 8000\n", "unknown setting 'prot' (did you mean port?), from config file"),
    ("block_size = 64\n", "unknown setting 'block_size' (did you mean cache.block_size?), from config file"),
    ("[cache]\nblok_size = 64\n", "unknown cache setting 'blok_size' (did you mean block_size?), from config file"),
    ("[memory]\nsoft_watermrk = 0.5\n", "unknown memory setting 'soft_watermrk' (did you mean soft_watermark?)"),
    ('[models."m"]\ncontxt_length = 9\n', "unknown setting 'contxt_length' in [models.\"m\"] (did you mean context_length?)"),
    ('[models."m".profiles.p]\ndefault_temprature = 0.1\n',
     "unknown setting 'default_temprature' in [models.\"m\".profiles.p] (did you mean default_temperature?)"),
    ("zzz = 1\n", "unknown setting 'zzz', from config file"),  # nothing close: no guess
    # a misspelled table is matched on the table names, not on the dotted keys under them
    ("[cahce]\nblock_size = 64\n", "unknown setting 'cahce' (did you mean cache?), from config file"),
    ("[clustr]\nheadroom = '1GB'\n", "unknown setting 'clustr' (did you mean cluster?), from config file"),
    ("cahce.block_size = 64\n", "unknown setting 'cahce' (did you mean cache?), from config file"),
    ("[alias]\nx = 'y'\n", "unknown setting 'alias' (did you mean aliases?), from config file"),
    ('[modls."m"]\npin = true\n', "unknown setting 'modls' (did you mean models?), from config file"),
])
def test_an_unknown_file_key_names_the_closest_known_key(tmp_path: Path, text: str, want: str):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config({}, {}, f)
    assert str(e.value).startswith(want), str(e.value)


def test_a_bad_value_is_named_as_the_file_wrote_its_key(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("models = 3\n")  # `models = [...]` is read as `model`: the error still says models
    with pytest.raises(ConfigError, match=r"^bad value for models: 3 \(expected a list\), from config file"):
        load_config({}, {}, f)
    f.write_text("[memory]\nceiling_bytes = 'lots'\n")
    with pytest.raises(ConfigError, match=r"^bad value for memory\.ceiling_bytes: 'lots'"):
        load_config({}, {}, f)


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


# ---- ranges, every source checked, names as the user wrote them (#20, the fresh-user check) -------

from omlx.config import PROFILE_KEYS, ModelSettings, unknown_env  # noqa: E402
from omlx.config_values import bounds_of  # noqa: E402
from omlx.tool_parsers import resolve_dialect_name  # noqa: E402

MODEL_NUMBERS = [n for n, i in ModelSettings.model_fields.items() if "int" in str(i.annotation) or "float" in str(i.annotation)]


def test_every_per_model_number_has_a_range():
    assert {"max_output_tokens", "default_top_k", "default_temperature", "context_length"} <= set(MODEL_NUMBERS)
    for name in MODEL_NUMBERS:
        assert bounds_of(ModelSettings.model_fields[name]) is not None, f"[models.\"<id>\"] {name} has no range"


def _api_range(model: type, field: str) -> tuple[float | None, float | None]:
    """(minimum, maximum) a request body model's JSON Schema gives ``field``."""
    prop = model.model_json_schema()["properties"][field]
    arm = next((a for a in prop.get("anyOf", [prop]) if a.get("type") in ("integer", "number")), prop)
    return arm.get("minimum"), arm.get("maximum")


def test_per_model_defaults_have_the_ranges_the_api_enforces():
    from omlx.api.bodies.openai import OneChoice, Sampling

    pairs = {"default_temperature": (Sampling, "temperature"), "default_top_p": (Sampling, "top_p"),
             "default_top_k": (Sampling, "top_k"), "default_min_p": (Sampling, "min_p"),
             "default_repetition_penalty": (Sampling, "repetition_penalty"),
             "default_max_tokens": (OneChoice, "max_tokens"), "max_output_tokens": (OneChoice, "max_tokens")}
    for name, (model, field) in pairs.items():
        b = bounds_of(ModelSettings.model_fields[name])
        assert (b.lo, b.hi) == _api_range(model, field), name


def _out_of_range(name: str) -> list[object]:
    b = bounds_of(ModelSettings.model_fields[name])
    integer = "int" in str(ModelSettings.model_fields[name].annotation)
    vals: list[object] = [b.lo if b.open_lo else b.lo - 1] if b.lo is not None else []
    if b.hi is not None:
        vals.append(b.hi + 1)
    return vals + ([] if integer else ["nan", "inf"])


MODEL_BAD = [(n, v) for n in MODEL_NUMBERS for v in _out_of_range(n)]


@pytest.mark.parametrize("name, bad", MODEL_BAD, ids=[f"{n}={v}" for n, v in MODEL_BAD])
def test_a_per_model_number_out_of_range_is_a_config_error_naming_file_and_key(tmp_path: Path, name: str, bad: object):
    f = tmp_path / "c.toml"
    f.write_text(f'[models."m"]\n{name} = {bad}\n')  # nan and inf are TOML floats
    with pytest.raises(ConfigError) as err:
        load_config({}, {}, f)
    msg = err.value.message
    assert msg.startswith(f'bad value for models."m".{name}: ') and "expected " in msg, msg
    assert msg.endswith(f"from config file {f}") and "\n" not in msg, msg
    if name in PROFILE_KEYS:  # a profile overlays them: checked there too
        f.write_text(f'[models."m".profiles.p]\n{name} = {bad}\n')
        with pytest.raises(ConfigError, match=rf'bad value for models\."m"\.profiles\.p\.{name}: '):
            load_config({}, {}, f)


def test_max_output_tokens_minus_one_was_a_500_and_is_now_refused_at_start(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text('[models."SmolLM2-135M-Instruct"]\nmax_output_tokens = -1\n')
    with pytest.raises(ConfigError, match=r'^bad value for models\."SmolLM2-135M-Instruct"\.max_output_tokens: -1 '
                                          r'\(expected an integer from 1 to 2147483647\), from config file '):
        load_config({}, {}, f)
    f.write_text('[models."m"]\nmax_output_tokens = 1\ndefault_temperature = 2.0\ndefault_top_k = 0\n')
    assert load_config({}, {}, f).model_settings["m"].max_output_tokens == 1


def test_an_unknown_tool_dialect_is_refused_and_an_alias_is_the_registry_name(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text('[models."m"]\ntool_dialect = "hermess"\n')
    with pytest.raises(ConfigError, match=r'bad value for models\."m"\.tool_dialect: \'hermess\' \(unknown tool dialect '
                                          r"'hermess'; use one of: .*hermes.*\), from config file "):
        load_config({}, {}, f, resolve_dialect=resolve_dialect_name)
    f.write_text('[models."m"]\ntool_dialect = "qwen3_coder"\n[models."m".profiles.p]\ntool_dialect = "nope"\n')
    with pytest.raises(ConfigError, match=r'models\."m"\.profiles\.p\.tool_dialect: \'nope\''):
        load_config({}, {}, f, resolve_dialect=resolve_dialect_name)
    f.write_text('[models."m"]\ntool_dialect = "qwen3_coder"\n')
    assert load_config({}, {}, f, resolve_dialect=resolve_dialect_name).model_settings["m"].tool_dialect == "qwen3_coder_xml"


PORTS = [("port", "OMLX_PORT", "port"), ("cluster.control_port", "OMLX_CLUSTER_CONTROL_PORT", "cluster.control_port"),
         ("cluster.worker_port", "OMLX_CLUSTER_WORKER_PORT", "cluster.worker_port")]


@pytest.mark.parametrize("key, var, toml", PORTS)
def test_ports_out_of_range_are_refused_from_every_source(tmp_path: Path, key: str, var: str, toml: str):
    f = tmp_path / "c.toml"
    high = 65505 if key == "cluster.worker_port" else 65536  # the ring uses worker_port .. + 31
    for bad in (0, -1, high, 99999):
        f.write_text(_toml(tuple(toml.split(".")), bad))
        with pytest.raises(ConfigError, match=rf"bad value for {toml}: {bad} \(expected an integer from 1 to \d+\), from config file"):
            load_config({}, {}, f)
        with pytest.raises(ConfigError, match=rf"bad value for {var}: '{bad}' \(expected an integer from 1 to \d+\), from the environment$"):
            load_config({}, {var: str(bad)}, None)
        with pytest.raises(ConfigError, match=r"expected an integer from 1 to \d+\), from the command line$"):
            load_config({key: bad}, {}, None)
    assert load_config({key: 1}, {}, None) and load_config({}, {var: str(high - 1)}, None)


def test_a_peer_port_out_of_range_is_refused():
    with pytest.raises(ConfigError, match=r"bad value for OMLX_CLUSTER_PEERS: 'a:1,b:70000' \(peer 'b:70000': expected host or host:port"):
        load_config({}, {"OMLX_CLUSTER_PEERS": "a:1,b:70000"}, None)
    assert load_config({}, {"OMLX_CLUSTER_PEERS": "a,b:8470,[::1]:9"}, None).cluster.peers == ("a", "b:8470", "[::1]:9")


def test_a_bad_value_in_a_lower_source_is_an_error_even_where_a_higher_one_sets_the_key(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("port = 'abc'\n")
    with pytest.raises(ConfigError, match=f"^bad value for port: 'abc' \\(expected an integer\\), from config file {f}$"):
        load_config({"port": 8001}, {"OMLX_PORT": "8002"}, f)
    f.write_text('[models."m"]\nmax_output_tokens = -1\n')
    with pytest.raises(ConfigError, match=r'models\."m"\.max_output_tokens: -1'):
        load_config({"model_settings": {"m": {"max_output_tokens": 10}}}, {}, f)
    f.write_text("port = 8003\n")
    with pytest.raises(ConfigError, match=r"^bad value for OMLX_PORT: '70000' .*, from the environment$"):
        load_config({"port": 8001}, {"OMLX_PORT": "70000"}, f)
    with pytest.raises(ConfigError, match=r"^bad value for --port: 0 .*from the command line; bad value for OMLX_LOG_LEVEL: "
                                          r"'LOUD' .*from the environment$"):
        load_config({"port": 0}, {"OMLX_LOG_LEVEL": "LOUD", "OMLX_PORT": "8002"}, f)
    # a check across keys reads the merged values: each source may set one side of it
    f.write_text("[cluster]\nheartbeat_timeout_s = 0.5\n")
    cfg = load_config({}, {"OMLX_CLUSTER_HEARTBEAT_INTERVAL_S": "0.1"}, f)
    assert (cfg.cluster.heartbeat_interval_s, cfg.cluster.heartbeat_timeout_s) == (0.1, 0.5)


@pytest.mark.parametrize("source", ["file", "env", "flags"])
def test_log_level_is_one_of_logging_names(tmp_path: Path, source: str):
    f = tmp_path / "c.toml"
    f.write_text("log_level = 'LOUD'\n" if source == "file" else "")
    with pytest.raises(ConfigError, match=r"'LOUD' \(expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL\)"):
        load_config({"log_level": "LOUD"} if source == "flags" else {},
                    {"OMLX_LOG_LEVEL": "LOUD"} if source == "env" else {}, f)
    assert load_config({"log_level": "warning"} if source == "flags" else {},
                       {"OMLX_LOG_LEVEL": "warning"} if source == "env" else {},
                       None).log_level == ("WARNING" if source != "file" else "INFO")


def test_errors_name_the_variable_and_the_flag_the_user_wrote():
    with pytest.raises(ConfigError, match=r"^bad value for OMLX_MEMORY_CEILING: 'lots' \(not a byte size"):
        load_config({}, {"OMLX_MEMORY_CEILING": "lots"}, None)
    with pytest.raises(ConfigError, match=r"^bad value for --memory-ceiling: 'lots' .*from the command line$"):
        load_config({"memory.ceiling_bytes": "lots"}, {}, None, flag_names={"memory.ceiling_bytes": "--memory-ceiling"})
    with pytest.raises(ConfigError, match=r"^bad value for --max-tpot-slowdown: -1\.0 "):
        load_config({"max_tpot_slowdown": -1.0}, {}, None)


def test_unknown_omlx_variables_are_named_with_a_close_match():
    lines = unknown_env({"OMLX_PORTT": "1", "OMLX_MAX_TPOT_SLOWDOWM": "3", "OMLX_PORT": "1", "OMLX_CONFIG": "x",
                         "OMLX_BLAS_REEXEC": "1", "OMLX_ZZZZZZ": "1", "PATH": "/bin"})
    assert lines == [
        "environment variable OMLX_MAX_TPOT_SLOWDOWM is not an omlx setting and is ignored (did you mean OMLX_MAX_TPOT_SLOWDOWN?)",
        "environment variable OMLX_PORTT is not an omlx setting and is ignored (did you mean OMLX_PORT?)",
        "environment variable OMLX_ZZZZZZ is not an omlx setting and is ignored",
    ]
    assert load_config({}, {"OMLX_PORTT": "1"}, None).port == 8000  # a warning, never an error
