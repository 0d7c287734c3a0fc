"""The Homebrew formula: Ruby syntax, resources = the lock = the runtime dependencies, and the
``--with-custom-kernel`` option wired to metal/build.py. Offline: nothing is downloaded."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omlx.kernels import sources

REPO = Path(__file__).resolve().parents[2]
FORMULA = REPO / "Formula" / "omlx.rb"


def _load_script():
    spec = importlib.util.spec_from_file_location("update_formula", REPO / "scripts" / "update_formula.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


uf = _load_script()


@pytest.fixture(scope="module")
def formula() -> str:
    return FORMULA.read_text()


def test_formula_is_valid_ruby():
    ruby = shutil.which("ruby")
    if ruby is None:
        pytest.skip("ruby is not installed (scripts/setup.sh installs Debian's ruby): cannot run `ruby -c`")
    r = subprocess.run([ruby, "-c", str(FORMULA)], capture_output=True, text=True)
    assert r.returncode == 0 and "Syntax OK" in r.stdout, r.stderr


def test_resources_match_the_lock(formula):
    assert uf.formula_resources(formula) == uf.parse_lock(), "run: python scripts/update_formula.py"


def test_every_resource_has_a_pinned_url_and_hash(formula):
    blocks = re.findall(r'resource "([^"]+)" do\s+url "([^"]+)"(.*)\n\s+sha256 "([^"]*)"', formula)
    assert len(blocks) == len(uf.parse_lock())
    for name, url, using, sha in blocks:
        assert url.startswith("https://files.pythonhosted.org/"), name
        assert re.fullmatch(r"[0-9a-f]{64}", sha), name
        # Wheels only for prebuilt binaries (or packages without an sdist), never unpacked.
        assert url.endswith(".whl") == ("nounzip" in using), name


def test_lock_covers_the_runtime_dependencies():
    lock = uf.parse_lock()
    from packaging.utils import canonicalize_name

    for req in uf.runtime_requirements():
        name = canonicalize_name(req.name)
        assert name in lock, f"{req} (pyproject.toml) is missing from requirements.lock: run update_formula.py --lock"
        assert req.specifier.contains(lock[name], prereleases=True), f"lock pins {name}=={lock[name]}, pyproject wants {req}"
    # Resolved for macOS: MLX's Metal library in, the Linux CPU build out.
    assert "mlx-metal" in lock and "mlx-cpu" not in lock
    assert lock["mlx-metal"] == lock["mlx"]


def test_option_name_matches_the_build_switch(formula):
    assert sources.BUILD_OPTION == "with-custom-kernel"
    assert re.search(rf'^\s*option "{sources.BUILD_OPTION}", "', formula, re.M)
    switches = set(re.findall(r'build\.with\?\s*\(?\s*"([^"]+)"', formula))
    assert switches == {sources.BUILD_OPTION.removeprefix("with-")}, switches
    # The formula runs the build script omlx knows, with flags it accepts.
    script = Path(sources.BUILD_SCRIPT)
    assert (REPO / script).is_file() and script.name in formula
    assert '"--sources"' in formula and '"--out"' in formula


def test_formula_service_and_test_blocks(formula):
    service = formula[formula.index("service do"):formula.index("test do")]
    assert 'run [opt_bin/"omlx", "serve"]' in service
    # as omlx start's own LaunchAgent (omlx.cli.service_backends.render_launchd_plist): restart
    # after a crash only, never throttled as a background job
    assert "keep_alive crashed: true" in service and "process_type :interactive" in service
    test = formula[formula.index("test do"):]
    assert "omlx doctor --json" in test and "native_kernel_status()" in test
    assert "xcodebuild -downloadComponent MetalToolchain" in formula and "xcrun" in formula


def test_build_script_emits_every_kernel(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / sources.BUILD_SCRIPT), "--emit-only", "--sources", str(REPO / "metal"),
                        "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    unit = (tmp_path / "kv_gather.gen.metal").read_text()
    # G=1, NB in {1,2,4,8}, 3 dtypes, 16-byte moves on/off: what kv_blocks launches on Metal.
    assert len(re.findall(r"\[\[kernel\]\] void omlx_kv_gather_g1_n\d+_", unit)) == 4 * 3 * 2
    assert sources.SELECT not in unit and "omlx_kv_gather_g1_n8_bfloat16_vec" in unit
    assert not (tmp_path / sources.MANIFEST).exists()


@pytest.mark.skipif(sys.platform == "darwin" and shutil.which("xcrun") is not None, reason="this Mac may have the toolchain")
def test_build_script_names_the_missing_metal_toolchain(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / sources.BUILD_SCRIPT), "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Metal toolchain is missing" in r.stderr and "xcodebuild -downloadComponent MetalToolchain" in r.stderr


def test_replace_resources_keeps_the_rest(formula):
    out = uf.replace_resources(formula, '  resource "x" do\n    url "u"\n    sha256 "s"\n  end\n')
    assert out.startswith(formula[:formula.index(uf.BEGIN)]) and out.endswith(formula[formula.index(uf.END) + len(uf.END):])
    assert 'resource "x"' in out and 'resource "mlx"' not in out
    with pytest.raises(ValueError):
        uf.replace_resources("class Omlx < Formula\nend\n", "")


def test_pick_file_prefers_sdists_and_fitting_wheels():
    files = [
        {"filename": "foo-1.0.tar.gz", "url": "https://x/foo-1.0.tar.gz", "hashes": {"sha256": "a" * 64}},
        {"filename": "foo-1.0-cp312-cp312-macosx_15_0_arm64.whl", "url": "https://x/w15", "hashes": {"sha256": "b" * 64}},
        {"filename": "foo-1.0-cp312-cp312-macosx_13_0_arm64.whl", "url": "https://x/w13", "hashes": {"sha256": "c" * 64}},
        {"filename": "foo-1.0-cp312-cp312-manylinux_2_35_x86_64.whl", "url": "https://x/lin", "hashes": {"sha256": "d" * 64}},
        {"filename": "foo-0.9.tar.gz", "url": "https://x/old", "hashes": {"sha256": "e" * 64}},
    ]
    assert uf.pick_file("foo", "1.0", files) == {"url": "https://x/foo-1.0.tar.gz", "sha256": "a" * 64, "wheel": False}
    # Wheel-only packages get the newest wheel the formula's macOS (14) can run.
    assert uf.pick_file("mlx", "1.0", [dict(f, filename=f["filename"].replace("foo", "mlx")) for f in files])["url"] == "https://x/w13"
    with pytest.raises(LookupError):
        uf.pick_file("foo", "2.0", files)
