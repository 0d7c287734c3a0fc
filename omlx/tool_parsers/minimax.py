"""MiniMax-M2 XML tool calls.

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="P">value</parameter>
    </invoke>
    </minimax:tool_call>

Own code rather than ``mlx_lm.tool_parsers.minimax_m2``, whose non-greedy regex cuts a value at
the first literal ``</parameter>`` (the Qwen XML bug, see test_mlx_lm_upstream.py). The shared
XML scanner closes a value only before ``<parameter name=`` or ``</invoke>``; several
``<invoke>`` in one block are parallel calls. A value is kept verbatim, newlines included:
the template (MiniMax-M2's chat_template.jinja) writes it between the tags with nothing added.
"""

from __future__ import annotations

from omlx.tool_parsers._xml import XmlGrammar, scan_block
from omlx.tool_parsers.base import Dialect, ScanContext, ScanResult

GRAMMAR = XmlGrammar(
    block_open="<minimax:tool_call>",
    block_close="</minimax:tool_call>",
    func_open="<invoke name=",
    func_close="</invoke>",
    param_open="<parameter name=",
    param_close="</parameter>",
    value_on_own_line=False,  # the M2 template writes <parameter name="k">{{ v }}</parameter>
)


class MiniMax(Dialect):
    name = "minimax"
    start_markers = (GRAMMAR.block_open,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        return scan_block(buf, GRAMMAR, ctx.memo)


DIALECT = MiniMax()
