"""`omlx bench` results: spreads over repeats, ratios between two servers, JSON and a table.

Every figure of every step is reported as ``{median, min, max, n}`` over the repeats (`summarize`).
With two servers, ``ratio`` per step and figure is oriented so that **above 1 means the base
server (``--base-url``) is better**: compare/base for times and memory (lower is better),
base/compare for tokens per second. The overall ratio of a figure is the geometric mean of its
step ratios; ``--min-ratio`` fails the run when any overall ratio is below it.
Must not: send requests (runner.py does).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

from omlx.bench.runner import BenchRun, StepRun
from omlx.units import bytes_in

#: Every figure in the JSON, with the unit its name ends in.
FIGURES = ("ttft_s", "tpot_s", "decode_tps", "aggregate_tps", "prompt_tokens", "cached_tokens",
           "completion_tokens", "peak_memory_bytes", "restart_s")
LOWER_IS_BETTER = ("ttft_s", "tpot_s", "peak_memory_bytes")
HIGHER_IS_BETTER = ("decode_tps", "aggregate_tps")
#: Figures whose overall ratio `--min-ratio` checks (speed; memory is reported, not gated).
GATED = ("ttft_s", "tpot_s", "decode_tps", "aggregate_tps")


def summarize(values: Iterable[float | None]) -> dict[str, Any]:
    """``{median, min, max, n}`` over the values that are not None (all None when there are none)."""
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def ratio(figure: str, base: float | None, other: float | None) -> float | None:
    """Above 1 when ``base`` is better; None when either is missing or zero, or the figure is
    neither a time, a memory figure nor a speed."""
    if base is None or other is None or base <= 0 or other <= 0:
        return None
    if figure in LOWER_IS_BETTER:
        return other / base
    if figure in HIGHER_IS_BETTER:
        return base / other
    return None


def geomean(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


def aggregate(bench: BenchRun, labels: list[str]) -> dict[str, Any]:
    """``{scenario: {step: {label: {figures, num_errors, skipped?}, ratio?}}}`` in run order."""
    grouped: dict[str, dict[str, dict[str, list[StepRun]]]] = {}
    for r in bench.runs:
        grouped.setdefault(r.scenario, {}).setdefault(r.step, {}).setdefault(r.target, []).append(r)
    out: dict[str, Any] = {}
    for scenario, steps in grouped.items():
        out[scenario] = {}
        for step, by_target in steps.items():
            entry: dict[str, Any] = {}
            for label in labels:
                runs = by_target.get(label, [])
                skipped = next((r.skipped for r in runs if r.skipped), None)
                figs = [r.figures() for r in runs if not r.skipped]
                entry[label] = {
                    "figures": {f: summarize(fs[f] for fs in figs) for f in FIGURES},
                    "num_repeats": len(figs),
                    "num_errors": sum(1 for r in runs for x in r.results if not x.ok),
                    **({"skipped": skipped} if skipped else {}),
                }
                errors = [x.error for r in runs for x in r.results if not x.ok and x.error]
                if errors:
                    entry[label]["errors"] = errors[:3]
            if len(labels) == 2:
                a, b = (entry[label]["figures"] for label in labels)
                entry["ratio"] = {f: _r(ratio(f, a[f]["median"], b[f]["median"])) for f in FIGURES
                                  if f in LOWER_IS_BETTER + HIGHER_IS_BETTER}
            out[scenario][step] = entry
    return out


def overall_ratios(scenarios: dict[str, Any]) -> dict[str, float | None]:
    """Geometric mean over all steps of each figure's ratio."""
    per: dict[str, list[float | None]] = {}
    for steps in scenarios.values():
        for entry in steps.values():
            for f, v in (entry.get("ratio") or {}).items():
                per.setdefault(f, []).append(v)
    return {f: _r(geomean(v)) for f, v in per.items()}


def check_min_ratio(overall: dict[str, float | None], min_ratio: float) -> list[str]:
    """The gated figures whose overall ratio is below ``min_ratio`` (missing ones fail too)."""
    return [f for f in GATED if overall.get(f) is None or overall[f] < min_ratio]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ---- the table for people --------------------------------------------------------------------

_FMT = {"ttft_s": ("TTFT", 1e3, "ms", 0), "tpot_s": ("TPOT", 1e3, "ms", 1), "decode_tps": ("decode", 1, "tok/s", 1),
        "aggregate_tps": ("aggregate", 1, "tok/s", 1), "cached_tokens": ("cached", 1, "tok", 0),
        "peak_memory_bytes": ("peak mem", bytes_in(1, "GB"), "GB", 2)}


def _cell(s: dict[str, Any], figure: str) -> str:
    _, scale, _, nd = _FMT[figure]
    if s["median"] is None:
        return "-"
    med = f"{s['median'] * scale:.{nd}f}"
    if s["n"] > 1 and s["min"] != s["max"]:
        return f"{med} [{s['min'] * scale:.{nd}f}-{s['max'] * scale:.{nd}f}]"
    return med


def render_table(result: dict[str, Any], console: Any) -> None:
    """Print one row per scenario step and server (median [min-max]) and the ratios (rich)."""
    from rich.markup import escape
    from rich.table import Table

    labels = list(result["targets"])
    table = Table(title=escape(f"omlx bench ({result['config']['repeat']} repeats; median [min-max])"))
    table.add_column("scenario/step")
    table.add_column("server")
    for f in _FMT:
        name, _, unit, _ = _FMT[f]
        table.add_column(f"{name} ({unit})", justify="right")
    for scenario, steps in result["scenarios"].items():
        for step, entry in steps.items():
            for label in labels:
                e = entry[label]
                if e.get("skipped"):
                    table.add_row(f"{scenario}/{step}", label, f"skipped: {e['skipped']}")
                    continue
                table.add_row(f"{scenario}/{step}", label, *[escape(_cell(e["figures"][f], f)) for f in _FMT])
            if "ratio" in entry:
                table.add_row("", "ratio", *[("-" if entry["ratio"].get(f) is None else f"{entry['ratio'][f]:.2f}x")
                                            if f in entry["ratio"] else "" for f in _FMT], style="bold")
    console.print(table)
    if "overall_ratio" in result:
        parts = ", ".join(f"{f} {('-' if v is None else f'{v:.2f}x')}" for f, v in result["overall_ratio"].items())
        console.print(f"overall ratio ({labels[0]} vs {labels[1]}, above 1 = {labels[0]} better): {parts}")
