"""The DS4 chat prompt of a server request (spec §5 "Server rendering").

Both APIs' messages are first turned into a `Conversation` (system text, turns, tools), which
renders as prompt parts: (True, special-token string) pushed by id, or (False, text) BPE'd on its
own, as ds4 builds prompts. A system and user message and the generation prompt give exactly the
ids of `ds4 generate --system S -p U` (ds4.core.chat.encode_prompt).

  BOS [Think-Max prefix] [tool schema prompt + system texts joined by a blank line]
  then per turn:  user -> <｜User｜>text
                  tool results -> <｜User｜><tool_result>...</tool_result>... (then any text)
                  assistant -> <｜Assistant｜> (<think>reasoning</think> | </think>) text
                               [DSML tool calls] <｜end▁of▁sentence｜>
  then <｜Assistant｜> and <think> (thinking) or </think>; or, when the last turn is the start
  of the reply (Conversation.continue_last), that turn without its <｜end▁of▁sentence｜>.

An assistant turn keeps its reasoning when thinking and (tools are offered or it follows the
last user turn, i.e. it is part of the current agent loop); earlier turns are closed with
</think> alone. The text of request messages is always text: a special-token string typed by a
client is BPE'd, never pushed as a token; only the server's own markup (the DSML of past tool
calls, the tool schema prompt and the system text) pushes `｜DSML｜` by id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ds4.core.chat import THINK_MAX_PREFIX, Part
from ds4.core.tokenizer import ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER

from .tools import ToolCall, ToolSpec, render_tool_calls, render_tool_prompt, render_tool_result



@dataclass
class Turn:
    role: str  # "user", "assistant" or "tool"
    text: str = ""
    reasoning: str | None = None  # assistant only
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant only
    tool_results: list[str] = field(default_factory=list)  # a tool turn: one or more results


@dataclass
class Conversation:
    system: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str | None = None  # None, "required" or a tool name (see render_tool_prompt)
    # the last turn is the start of the reply, which the answer continues (Anthropic's prefilled
    # assistant message): it stays open, with no generation prompt after it
    continue_last: bool = False


def _dsml_parts(text: str) -> list[Part]:
    """Server-made markup: its `｜DSML｜` strings become the special token."""
    parts: list[Part] = []
    pieces = text.split(DSML)
    for i, piece in enumerate(pieces):
        if i:
            parts.append((True, DSML))
        if piece:
            parts.append((False, piece))
    return parts


def conversation_parts(conv: Conversation, *, think: bool, think_max: bool = False,
                       add_generation_prompt: bool = True) -> list[Part]:
    parts: list[Part] = [(True, BOS)]
    if think_max:
        parts.append((False, THINK_MAX_PREFIX))
    system = ([render_tool_prompt(conv.tools, conv.tool_choice)] if conv.tools else []) + conv.system
    if system:
        # (the schema prompt shows the markup with `｜DSML｜` as the token the model writes)
        parts += _dsml_parts("\n\n".join(system))
    last_user = max((i for i, t in enumerate(conv.turns) if t.role == "user"), default=-1)
    for i, turn in enumerate(conv.turns):
        if turn.role == "user":
            parts += [(True, USER), (False, turn.text)]
        elif turn.role == "tool":
            results = "".join(render_tool_result(r) for r in turn.tool_results)
            parts += [(True, USER), (False, results + turn.text)]
        elif turn.role == "assistant":
            parts.append((True, ASSISTANT))
            if think and (conv.tools or i > last_user):
                parts += [(True, THINK_START), (False, turn.reasoning or ""), (True, THINK_END)]
            else:
                parts.append((True, THINK_END))
            parts.append((False, turn.text))
            if turn.tool_calls:
                parts += _dsml_parts(render_tool_calls(turn.tool_calls))
            if add_generation_prompt and conv.continue_last and i == len(conv.turns) - 1:
                return [(special, text) for special, text in parts if special or text]
            parts.append((True, EOS))
        else:
            raise ValueError(f"turn role: expected user, assistant or tool, got {turn.role!r}")
    if add_generation_prompt:
        parts += [(True, ASSISTANT), (True, THINK_START if think else THINK_END)]
    return [(special, text) for special, text in parts if special or text]


def add_turn(conv: Conversation, turn: Turn) -> None:
    """Append a turn, merging consecutive tool turns into one user turn of results."""
    if turn.role == "tool" and conv.turns and conv.turns[-1].role == "tool" and not conv.turns[-1].text:
        conv.turns[-1].tool_results += turn.tool_results
        conv.turns[-1].text = turn.text
        return
    conv.turns.append(turn)
