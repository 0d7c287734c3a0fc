"""The one size formatter (omlx/units.py) and the dashboard's copy of it, and a check over omlx/
that no other code formats sizes or rates for people (it is shown catching the old forms)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from omlx.units import BYTES_PER_UNIT, bytes_in, format_bytes, format_rate

PKG = Path(__file__).resolve().parents[2] / "omlx"
DASHBOARD = PKG / "api" / "static" / "admin.html"


@pytest.mark.parametrize("num_bytes, unit, digits, text", [
    (0, None, 2, "0 B"),
    (512, None, 2, "512 B"),
    (999, None, 2, "999 B"),
    (1000, None, 2, "1.00 KB"),
    (1_234_567, None, 2, "1.23 MB"),
    (1_234_567_890, None, 2, "1.23 GB"),
    (17_179_869_184, None, 1, "17.2 GB"),  # 16 GiB of RAM, in decimal GB
    (2.5e15, None, 2, "2,500.00 TB"),
    (-3e9, None, 2, "-3.00 GB"),  # a shortfall
    (990e6, "GB", 2, "0.99 GB"),  # a message comparing sizes keeps one unit
    (87_812_345, "MB", 1, "87.8 MB"),
    (1_234_567_890, "MB", 0, "1,235 MB"),
    (1536, "B", 2, "1,536 B"),
])
def test_format_bytes(num_bytes: float, unit: str | None, digits: int, text: str) -> None:
    assert format_bytes(num_bytes, unit, digits) == text


def test_rates_and_columns_use_the_same_units() -> None:
    assert format_rate(4e8) == "400.00 MB/s" and format_rate(5e10, "GB", 1) == "50.0 GB/s"
    assert bytes_in(1.5e9, "GB") == 1.5 and BYTES_PER_UNIT["GB"] == 10**9
    with pytest.raises(KeyError):
        format_bytes(1, "GiB")


SAMPLES = [None, 0, 1, 999, 1000, 1023, 1024, 65_536, 1_048_576, 84_312_345, 999_999, 1_073_741_824,
           12e9, 17_179_869_184, 7.3e12, 2.5e15]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_dashboard_formats_sizes_as_python_does() -> None:
    script = DASHBOARD.read_text()
    fn = re.search(r"^function fmtBytes\(.*$", script, re.MULTILINE)
    assert fn, "admin.html has no one-line function fmtBytes"
    js = fn.group(0) + f"\nconsole.log(JSON.stringify({json.dumps(SAMPLES)}.map(b => fmtBytes(b))));"
    out = subprocess.run(["node", "-e", js], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == ["-" if b is None else format_bytes(b) for b in SAMPLES]


# A size or rate formatted by hand: a division by a size unit, a shift by one, a scale factor, or a
# number printed right before a unit ("%.1f MB", "{x:.2f} GB", "%d MiB").
_SIZE = r"(?:1e6|1e9|1e12|10\s*\*\*\s*(?:6|9|12)|2\s*\*\*\s*(?:10|20|30|40)|1\s*<<\s*(?:10|20|30|40)|1024|[KMGT]i?B)\b"
PY_PATTERNS = [
    re.compile(r"/\s*\(?\s*" + _SIZE),
    re.compile(r">>\s*(?:10|20|30|40)\b"),
    re.compile(r"\*\s*1e-(?:6|9|12)\b"),
    re.compile(r"(?:%[-+ #0-9.,]*[dfgi]|\})\s?[KMGT]i?B\b"),
]
JS_PATTERNS = [
    re.compile(r"/\s*\(?\s*(?:1e6|1e9|1024|1\s*<<\s*\d+)\b"),  # (/ 1000 is ms -> s)
    re.compile(r"[\"'`]\s?[KMGT]i?B\b"),
]


def _hand_formatting(text: str, patterns: list[re.Pattern[str]]) -> list[str]:
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in patterns)]


def test_the_check_catches_hand_formatting() -> None:
    # The forms this check replaced, one per pattern: it can fail.
    old_py = ['f"{free / 1e9:.1f} GB free"', '"budget %.1f MB", self._max_bytes / 1e6',
              '"%.1f GB/s over %d MiB", rate / 1e9, num_bytes >> 20', '("peak mem", 1 / 2**30, "GiB", 2)',
              'f"{size / GB:.2f}"', 'f"{n:.1f} {unit}" if x else f"{n:.1f} GB"', "scale = n * 1e-9"]
    assert [s for s in old_py if not _hand_formatting(s, PY_PATTERNS)] == []
    old_js = ('function gb(b) { if (b >= 1 << 30) return (b / (1 << 30)).toFixed(2) + " GiB"; '
              'return (b / 1024).toFixed(0) + " KiB"; }')
    assert _hand_formatting(old_js, JS_PATTERNS)
    assert not _hand_formatting('format_bytes(n, "GB")  # "weights GB" header, e.g. 12GB', PY_PATTERNS)


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if p.name != "units.py"),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_sizes_are_formatted_by_omlx_units_only(path: Path) -> None:
    found = _hand_formatting(path.read_text(), PY_PATTERNS)
    assert not found, f"{path.relative_to(PKG)} formats sizes itself (use omlx.units.format_bytes): {found}"


def test_the_dashboard_formats_sizes_in_fmtbytes_only() -> None:
    script = re.sub(r"^function fmtBytes\(.*$", "", DASHBOARD.read_text(), flags=re.MULTILINE)
    found = _hand_formatting(script, JS_PATTERNS)
    assert not found, f"admin.html formats sizes outside fmtBytes: {found}"
