"""Qwen3-Coder / Qwen3.5 XML tool calls.

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

Own code rather than ``mlx_lm.tool_parsers.qwen3_coder``, which cuts a value at the first
literal ``</parameter>`` (case qwen-xml-closing-tag-inside-arg) and raises when a value does not
convert to its schema type, dropping the call (case qwen-xml-uncoercible-typed-param). Here
``</parameter>`` closes a value only before ``<parameter=`` or ``</function>``, ``</tool_call>``
only after ``</function>``, and values stay strings until the shared schema coercion.
"""

from __future__ import annotations

from omlx.tool_parsers._xml import XmlGrammar, scan_block
from omlx.tool_parsers.base import Dialect, ScanContext, ScanResult

GRAMMAR = XmlGrammar(
    block_open="<tool_call>",
    block_close="</tool_call>",
    func_open="<function=",
    func_close="</function>",
    param_open="<parameter=",
    param_close="</parameter>",
)


class Qwen3CoderXml(Dialect):
    name = "qwen3_coder_xml"
    start_markers = (GRAMMAR.block_open,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        return scan_block(buf, GRAMMAR, ctx.memo)


DIALECT = Qwen3CoderXml()
