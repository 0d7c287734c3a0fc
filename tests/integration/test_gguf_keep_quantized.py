"""`omlx models import FILE.gguf --keep-quantized`: the real SmolLM2 Q4_1 GGUF (its embedding in
Q8_0) stays quantized, converted exactly to MLX's affine format: a folder about a fifth of the
float32 import's size whose perplexity is the float32 import's, where quantizing the float32
import again with mlx-lm (4-bit, group 64) loses quality."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from omlx.cli.main import app
from tests.helpers import TEST_HOME, default_model_dir, quantized_model_dir

runner = CliRunner()


def test_keep_quantized_import_is_exact_and_small(tmp_path):
    from mlx_lm import load

    from omlx.engine.embedded import default_model_gguf
    from tests.reference import paragraph_ids, perplexity

    gguf = default_model_gguf(TEST_HOME / "models" / ".cache")
    home = tmp_path / "home"
    r = runner.invoke(app, ["models", "import", str(gguf), "--name", "smol-q41", "--keep-quantized", "--base-path", str(home)])
    assert r.exit_code == 0 and "the GGUF's quantized weights kept" in r.output, r.output
    folder = home / "models" / "smol-q41"
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    r = runner.invoke(app, ["models", "list", "--json", "--base-path", str(home), "--hub-cache-dir", str(tmp_path / "none")])
    (row,) = json.loads(r.stdout)
    assert (row["source"], row["quantization"], row["group_size"], row["prefix_cache"]) == \
        ("GGUF import", "mixed 4/8-bit", 32, "on")
    float_bytes = (default_model_dir() / "model.safetensors").stat().st_size
    assert (folder / "model.safetensors").stat().st_size < float_bytes / 4

    ppl = {}
    for key, path in (("kept", folder), ("float32", default_model_dir()), ("requantized", quantized_model_dir(4))):
        model, tok = load(str(path))
        ppl[key] = perplexity(model, paragraph_ids(tok))
    assert abs(ppl["kept"] - ppl["float32"]) / ppl["float32"] < 1e-3, ppl
    assert ppl["requantized"] > ppl["float32"] * 1.05, ppl  # shows this check can tell a lossy conversion
    r = runner.invoke(app, ["models", "import", str(default_model_dir()), "--keep-quantized", "--base-path", str(home)])
    assert r.exit_code == 1 and "--keep-quantized applies to a .gguf file" in r.output
