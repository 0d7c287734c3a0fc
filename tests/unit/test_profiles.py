"""Per-model TOML settings and `<model>:<profile>` overlays."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx.config import ModelSettings, load_config
from omlx.errors import ConfigError
from omlx.profiles import effective_settings, overlay, profile_id, split_profile_id

TOML = '''
[memory]
ceiling = "12GB"
soft_watermark = 0.8
load_wait_s = 30
[models."smol"]
context_length = 4096
default_temperature = 0.7
default_top_p = 0.9
ttl_s = 600
pin = true
aliases = ["gpt-4o-mini", "claude-haiku-4-5"]
enable_thinking = false
[models."smol".profiles.precise]
default_temperature = 0
default_max_tokens = 256
[models."smol".profiles.long]
max_output_tokens = 8000
'''


def test_model_settings_and_memory_from_toml(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text(TOML)
    cfg = load_config({}, {}, f)
    assert (cfg.memory.ceiling_bytes, cfg.memory.soft_watermark, cfg.memory.load_wait_s) == (12 * 10**9, 0.8, 30.0)
    s = cfg.model_settings["smol"]
    assert (s.context_length, s.default_temperature, s.ttl_s, s.pin, s.enable_thinking) == (4096, 0.7, 600.0, True, False)
    assert s.aliases == ("gpt-4o-mini", "claude-haiku-4-5")
    assert set(s.profiles) == {"precise", "long"}
    assert s.profiles["precise"].default_temperature == 0.0
    assert load_config({"memory.ceiling_bytes": "2GB"}, {"OMLX_MEMORY_CEILING": "3GB"}, f).memory.ceiling_bytes == 2 * 10**9
    assert load_config({}, {"OMLX_MEMORY_CEILING": "3GB"}, f).memory.ceiling_bytes == 3 * 10**9


@pytest.mark.parametrize("text, words", [
    ('[models."m"]\nttl = 5\n', "unknown setting 'ttl'"),
    ('[models."m"]\npin = "yes"\n', r"bad value for models.\"m\".pin: 'yes' \(expected true or false\), from config file"),
    ('[models."m"]\ntask = "vision"\n', "task must be one of"),
    ('[models."m".profiles.p]\npin = true\n', "cannot be set in a profile"),
    ('[models."m".profiles."a:b"]\ndefault_temperature = 0\n', "bad profile name"),
    ('[memory]\nsoft_watermark = 0.99\nhard_watermark = 0.9\n', "watermarks"),
    ('[memory]\nnope = 1\n', "unknown memory setting"),
])
def test_bad_settings_name_the_key(tmp_path: Path, text: str, words: str):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_config({}, {}, f)


def test_overlay_and_ids():
    base = ModelSettings(default_temperature=0.7, default_max_tokens=100, ttl_s=60, pin=True,
                         profiles={"p": ModelSettings(default_max_tokens=5, enable_thinking=True)})
    eff = effective_settings(base, "p")
    assert (eff.default_temperature, eff.default_max_tokens, eff.enable_thinking) == (0.7, 5, True)
    assert (eff.ttl_s, eff.pin, eff.profiles) == (60, True, {})  # model-level fields untouched
    assert effective_settings(base, None) is base and effective_settings(base, "nope") is None
    assert overlay(base, ModelSettings()).default_max_tokens == 100
    assert split_profile_id("smol:precise") == ("smol", "precise")
    assert split_profile_id("a:b:c") == ("a:b", "c")
    assert split_profile_id("smol") is None and split_profile_id(":x") is None and split_profile_id("x:") is None
    assert profile_id("smol", "p") == "smol:p"
