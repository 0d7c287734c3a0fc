"""Content a text model cannot read: the one rule for images, documents, audio and files.

Agents send screenshots and PDFs mid-session (a file read of a .png, a tool that returns an
image), and a 400 there ends the whole agent session. So every such content block or part, at
the top level of a message or inside an Anthropic ``tool_result`` or a Responses
``function_call_output``, is served as a short placeholder naming its kind, where it stood; the
text around it is served as sent. A request's `DroppedContent` counts what was dropped (the API
layer logs it once per request and counts it in ``/metrics``); with ``strict_content`` (config)
the first such block is a 400 instead, naming it.

The placeholder depends on the kind only, never on the content's bytes, so a conversation that
carries an image renders to the same prompt on every later turn and the prefix cache still hits.

Kinds, and the wire types (Anthropic Messages, OpenAI chat, OpenAI Responses) that are each:

- ``image``: Anthropic ``image``; OpenAI ``image_url``; Responses ``input_image``;
- ``document``: Anthropic ``document`` whose source is not text (an Anthropic ``document`` with a
  text source is text, and its text is served);
- ``audio``: OpenAI ``input_audio``;
- ``file``: Anthropic ``file``, ``container_upload``; OpenAI ``file``; Responses ``input_file``.

Must not: import mlx or know HTTP (logging and metrics are the API layer's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omlx.errors import InvalidRequestError

#: wire type of a content block or part -> its kind (module doc).
KIND_OF_TYPE: dict[str, str] = {
    "image": "image", "image_url": "image", "input_image": "image",
    "document": "document",
    "input_audio": "audio",
    "file": "file", "input_file": "file", "container_upload": "file",
}
#: every kind, in a fixed order (log lines, metric labels).
KINDS = ("image", "document", "audio", "file")


def unreadable_kind(wire_type: Any) -> str | None:
    """The kind of a content block or part type this text model cannot read; None for any other
    type (text, tool calls, unknown types)."""
    return KIND_OF_TYPE.get(wire_type) if isinstance(wire_type, str) else None


def placeholder(kind: str) -> str:
    """The text served where a content block of ``kind`` was, e.g.
    ``[image omitted: this model reads text only]`` (the same on every request)."""
    return f"[{kind} omitted: this model reads text only]"


@dataclass(slots=True)
class DroppedContent:
    """What one request's mapping dropped, and whether it may drop anything at all.

    Attributes:
        strict: ``ServerConfig.strict_content``: `drop` raises the 400 instead.
        counts: kind -> number of content blocks or parts served as a placeholder.
    """

    strict: bool = False
    counts: dict[str, int] = field(default_factory=dict)

    def drop(self, kind: str, message: str, param: str) -> str:
        """Count one content block of ``kind`` as dropped and return its `placeholder`.

        Args:
            message, param: the 400 to raise when `strict` (its message names ``param``).

        Raises:
            InvalidRequestError: when `strict`.
        """
        if self.strict:
            raise InvalidRequestError(message, param=param)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return placeholder(kind)

    @property
    def num_dropped(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """``"2 image, 1 document"``: the counts in `KINDS` order ('' when nothing was dropped)."""
        return ", ".join(f"{self.counts[k]} {k}" for k in KINDS if self.counts.get(k))
