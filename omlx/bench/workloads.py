"""The `omlx bench` scenarios as data: steps of chat request bodies, built from a seed.

A `Step` is one wave of requests sent together (one for most steps, N for concurrency N); a
scenario is a list of steps run in order against one server. Bodies are plain OpenAI
chat-completions JSON without ``model``/``stream`` (the client adds them), identical for every
server compared, and greedy (``temperature: 0``) so replies are comparable.

Scenarios (`build`):

- ``decode``: one stream writing at length (``max_tokens`` output tokens).
- ``concurrency``: N identical-shape streams at once for each N in ``concurrency`` (distinct
  seeds, so no stream reuses another's prefix).
- ``cache``: a long prompt cold, the identical prompt, the prompt plus a suffix, the prompt with
  one sentence in the middle changed (a fresh seed per repeat keeps "cold" cold).
- ``agent``: a coding-agent trace: a large system prompt, tool definitions, a history that grows
  by an assistant tool call and a tool result per turn, and one edit of an early tool result
  in the middle of the trace (as agents do when they prune context).
- ``edit``: a Python module in the prompt (about twice ``max_tokens`` long), the model asked to
  return it with one function renamed: the output repeats the input (what prompt-lookup
  drafting, ``--lookup-draft-tokens``, speeds up; compare a server with it off).
- ``restart``: the cold long prompt, then (after the runner restarts the server it manages)
  the same prompt again: what the SSD tier brings back.

Must not: send anything (runner.py does) or import omlx's server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from omlx.bench.prompts import PromptFactory

SCENARIOS = ("decode", "concurrency", "cache", "agent", "edit", "restart")


@dataclass(slots=True)
class Step:
    """One wave of requests sent at once.

    Attributes:
        name: unique within the scenario ("cold", "c4", "turn-3"...).
        bodies: chat-completions bodies (no model, no stream).
        restart_before: the runner restarts its managed server before this step.
    """

    name: str
    bodies: list[dict[str, Any]]
    restart_before: bool = False


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Sizes of every scenario.

    Attributes:
        seed: base seed of all text (a repeat adds its index).
        max_tokens: output tokens of decode and concurrency streams.
        reply_tokens: output tokens of cache, agent and restart requests (prefill is the point).
        prompt_tokens: length of the long prompt (cache, restart) and of the agent's system prompt.
        concurrency: stream counts of the concurrency scenario.
        agent_turns: requests in the agent trace (>= 2).
        tool_result_tokens: length of each tool result in the agent trace.
    """

    seed: int = 0
    max_tokens: int = 128
    reply_tokens: int = 16
    prompt_tokens: int = 2048
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    agent_turns: int = 6
    tool_result_tokens: int = 256


def _body(messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra}


QUESTION = "\n\nSummarize the text above in one sentence."

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository and return its text.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string", "description": "Only files matching this."}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace an exact string in a file with another.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite (or some tests) and return the output.",
        "parameters": {"type": "object", "properties": {"paths": {"type": "array", "items": {"type": "string"}}}}}},
]


def decode(pf: PromptFactory, cfg: WorkloadConfig, seed: int) -> list[Step]:
    return [Step("decode", [_body([{"role": "user", "content": pf.essay(seed)}], cfg.max_tokens)])]


def concurrency(pf: PromptFactory, cfg: WorkloadConfig, seed: int) -> list[Step]:
    return [Step(f"c{n}", [_body([{"role": "user", "content": pf.essay(seed * 1000 + n * 100 + i)}], cfg.max_tokens)
                           for i in range(n)]) for n in cfg.concurrency]


def cache(pf: PromptFactory, cfg: WorkloadConfig, seed: int) -> list[Step]:
    lines = pf.lines(f"cache:{seed}", cfg.prompt_tokens)
    text = "\n".join(lines)
    edited = list(lines)
    mid = len(edited) // 2
    edited[mid] = pf.words(f"edit:{seed}", 10).capitalize() + "."
    suffix = "\n" + pf.words(f"suffix:{seed}", 48)

    def ask(t: str) -> dict[str, Any]:
        return _body([{"role": "user", "content": t + QUESTION}], cfg.reply_tokens)

    return [Step("cold", [ask(text)]), Step("identical", [ask(text)]), Step("suffix", [ask(text + suffix)]),
            Step("middle_edit", [ask("\n".join(edited))])]


def agent(pf: PromptFactory, cfg: WorkloadConfig, seed: int) -> list[Step]:
    system = ("You are a coding agent working in a Python repository. Use the tools to read, search and "
              "edit files and to run the tests. Keep answers short.\n\nProject notes:\n"
              + pf.text(f"agent-system:{seed}", cfg.prompt_tokens))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "The test test_cache_eviction fails after the last change. Find out why and fix it."},
    ]
    tools = ["read_file", "search", "read_file", "run_tests", "edit_file"]
    steps: list[Step] = []
    edit_turn = max(2, cfg.agent_turns // 2 + 1)
    first_result_index: int | None = None
    for turn in range(1, cfg.agent_turns + 1):
        edit = turn == edit_turn and first_result_index is not None
        if edit:  # the agent prunes an early tool result: everything after it is new to the cache
            messages[first_result_index] = {**messages[first_result_index],
                                            "content": "[output elided to save context]"}
        steps.append(Step(f"turn-{turn}" + ("-edit" if edit else ""),
                          [_body(json.loads(json.dumps(messages)), cfg.reply_tokens, tools=TOOLS)]))
        name = tools[(turn - 1) % len(tools)]
        call_id = f"call_{seed}_{turn}"
        args = {"path": f"omlx/module_{turn}.py"} if name in ("read_file", "edit_file") else {"pattern": "evict"}
        if name == "edit_file":
            args.update(old="return None", new="return self._evict()")
        if name == "run_tests":
            args = {"paths": ["tests/test_cache.py"]}
        # content beside tool_calls: templates without tool support (SmolLM2) need a text
        messages.append({"role": "assistant", "content": f"Calling {name}.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": pf.text(f"agent-tool:{seed}:{turn}", cfg.tool_result_tokens)})
        if first_result_index is None:
            first_result_index = len(messages) - 1
    return steps


def edit(pf: PromptFactory, cfg: WorkloadConfig, seed: int) -> list[Step]:
    source, names = pf.code(f"edit:{seed}", max(256, 2 * cfg.max_tokens))
    old = names[0]
    ask = (f"Here is a Python module:\n\n```python\n{source}\n```\n\nReturn the whole module unchanged except "
           f"that the function `{old}` is renamed to `{old}_v2`. Reply with the code only.")
    return [Step("edit", [_body([{"role": "user", "content": ask}], cfg.max_tokens)])]


def restart(pf: PromptFactory, cfg: WorkloadConfig, seed: int) -> list[Step]:
    text = pf.text(f"restart:{seed}", cfg.prompt_tokens)
    body = _body([{"role": "user", "content": text + QUESTION}], cfg.reply_tokens)
    return [Step("cold", [body]), Step("after_restart", [body], restart_before=True)]


BUILDERS = {"decode": decode, "concurrency": concurrency, "cache": cache, "agent": agent, "edit": edit,
            "restart": restart}


def build(scenario: str, pf: PromptFactory, cfg: WorkloadConfig, repeat: int) -> list[Step]:
    """The steps of ``scenario`` for repeat number ``repeat`` (0-based; it shifts the seed).

    Raises:
        ValueError: unknown scenario name.
    """
    if scenario not in BUILDERS:
        raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
    return BUILDERS[scenario](pf, cfg, cfg.seed * 1_000 + repeat)
