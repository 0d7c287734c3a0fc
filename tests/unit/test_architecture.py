"""The import contract of DESIGN.md, checked on the source (AST), so a wrong import fails CI.

cli -> {api, cluster, bench} -> pool -> engine -> scheduler -> cache -> {memory, kernels,
tool_parsers, profiles} -> {request, config} -> config_values -> errors; api and cluster never import each other;
sanic only in api/, typer only in cli/, zeroconf only in cluster/discovery.py, prometheus_client
only in api/; the pure core imports neither mlx nor numpy; bench/ is an HTTP client that imports
nothing of omlx's server (no api, pool, engine, mlx) beyond omlx.units (the size formatter) and
omlx.errors. pool/ is one unit split by job; inside it the parts import one way too (`POOL_ORDER`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "omlx"

LEVEL = {
    "cli": 0,
    "api": 1, "cluster": 1, "bench": 1,
    "pool": 2,
    "engine": 3,
    "scheduler": 4,
    "cache": 5,
    "memory": 6, "kernels": 6, "tool_parsers": 6, "profiles": 6,
    "request": 7, "config": 7, "errors": 7.5,
    "config_values": 7.2,  # config's value types and their parsers: import nothing of omlx
    "units": 7.8,  # the size formatter: imports nothing of omlx, so every layer may use it
    "__init__": 8, "__main__": -1,
}
PURE = ["cache/hashing.py", "cache/paged.py", "scheduler.py", "cluster/plan.py",
        # the cluster control plane: no arrays (the streaming probe lives in cluster/measure.py)
        "cluster/membership.py", "cluster/control.py", "cluster/launcher.py", "cluster/agent.py",
        "cluster/serving.py", "units.py",
        # the cluster front's stream relay: bytes in, bytes out
        "api/sse_relay.py",
        # the one request state the engine, the runner and (to come) the scheduler read
        "engine/request_state.py"]


#: omlx/pool/, its face first, then its parts from the front down: a part imports only parts after
#: it, and none imports the face (``omlx.pool``, which imports them all).
POOL_ORDER = ["__init__", "engine_pool", "status", "memory_policy", "loaded", "catalogue", "model"]


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


MODULES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_go_downward(path):
    unit = _unit(path)
    if unit not in LEVEL:
        pytest.fail(f"{path.relative_to(PKG)}: top-level unit {unit!r} is not in DESIGN.md's layout")
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] != "omlx" or len(parts) < 2:
            continue
        target = parts[1]
        if target == unit:
            continue
        assert target in LEVEL, f"{path}: imports unknown unit omlx.{target}"
        assert LEVEL[target] > LEVEL[unit] or unit == "__main__", (
            f"{path.relative_to(PKG)} (level {LEVEL[unit]}) imports omlx.{target} (level {LEVEL[target]}): upward import"
        )
        assert {unit, target} != {"api", "cluster"}, f"{path}: api and cluster must not import each other"


@pytest.mark.parametrize("path", sorted((PKG / "pool").glob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_pool_parts_import_one_way(path):
    rel = path.relative_to(PKG)
    assert path.stem in POOL_ORDER, f"{rel} is not in POOL_ORDER: give it its place among the pool's parts"
    for name in _imports(path):
        parts = name.split(".")
        if parts[:2] != ["omlx", "pool"]:
            continue
        assert len(parts) > 2, f"{rel} imports the face omlx.pool; import the part that defines the name"
        assert POOL_ORDER.index(parts[2]) > POOL_ORDER.index(path.stem), f"{rel} imports {name}: upward inside pool/"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_framework_imports_stay_in_their_layer(path):
    rel = str(path.relative_to(PKG))
    for name in _imports(path):
        top = name.split(".")[0]
        if top == "sanic":
            assert rel.startswith("api/"), f"{rel} imports sanic"
        if top == "typer":
            assert rel.startswith("cli/"), f"{rel} imports typer"
        if top == "zeroconf":
            assert rel == "cluster/discovery.py", f"{rel} imports zeroconf"
        if top == "prometheus_client":
            assert rel.startswith("api/"), f"{rel} imports prometheus_client"


@pytest.mark.parametrize("path", sorted((PKG / "bench").rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_bench_talks_http_only(path):
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] == "omlx" and name != "omlx.errors":  # the error tree: a leaf that imports nothing
            assert len(parts) > 1 and parts[1] in ("bench", "units"), f"{path.relative_to(PKG)} imports {name}"
        assert parts[0] not in ("mlx", "mlx_lm", "sanic"), f"{path.relative_to(PKG)} imports {name}"


@pytest.mark.parametrize("rel", PURE)
def test_pure_core_has_no_mlx(rel):
    path = PKG / rel
    assert path.exists(), f"{rel} is part of DESIGN.md's pure core"
    for name in _imports(path):
        assert name.split(".")[0] not in ("mlx", "numpy", "mlx_lm"), f"{rel} imports {name}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_distributed_stays_in_cluster(path):
    """Collectives (``mx.distributed``) only in cluster/: everything else is single-process."""
    rel = str(path.relative_to(PKG))
    tree = ast.parse(path.read_text(), filename=str(path))
    uses = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "distributed"]
    assert not uses or rel.startswith("cluster/"), f"{rel} uses mx.distributed on lines {uses}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_fault_injection_stays_in_the_engine(path):
    """The test-only fault hook (engine/faults.py) is wired by the engine and its factory only,
    and its variable OMLX_TEST_FAULT is read in config.py only."""
    rel = str(path.relative_to(PKG))
    if "omlx.engine.faults" in _imports(path):
        assert rel in ("engine/engine.py", "engine/factory.py"), f"{rel} imports the test-only fault hook"
    text = path.read_text()
    if "OMLX_TEST_FAULT" in text and ("environ" in text or "getenv" in text) and rel != "config.py":
        pytest.fail(f"{rel} may read OMLX_TEST_FAULT from the environment; only config.py does")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_request_parking_stays_in_the_request_holds(path):
    """The test-only park (api/park.py) is wired by api/holds.py only (routes reach it through
    their RequestHolds), and its variable OMLX_TEST_PARK is read in config.py only."""
    rel = str(path.relative_to(PKG))
    if "omlx.api.park" in _imports(path):
        assert rel == "api/holds.py", f"{rel} imports the test-only park"
    text = path.read_text()
    if "OMLX_TEST_PARK" in text and ("environ" in text or "getenv" in text) and rel != "config.py":
        pytest.fail(f"{rel} may read OMLX_TEST_PARK from the environment; only config.py does")


@pytest.mark.parametrize("rel", ["api/openapi.py", "engine/faults.py"])
def test_small_new_modules_have_no_framework(rel):
    for name in _imports(PKG / rel):
        assert name.split(".")[0] not in ("sanic", "mlx", "mlx_lm"), f"{rel} imports {name}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_nothing_subclasses_the_engine(path):
    """The engine is composed, never subclassed (issue 18): the cluster's rank 0 hands the
    engine a `Pipeline` (omlx.cluster.worker.ClusterPipeline) instead of overriding its private
    step-loop methods."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            assert not any(b.split(".")[-1] == "Engine" for b in bases), \
                f"{path.relative_to(PKG)}: class {node.name}({', '.join(bases)}) subclasses the engine"
