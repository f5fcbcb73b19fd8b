"""DS4's own tool-call markup (DSML, spec §5 "Server rendering").

A reply that calls tools ends with one block

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`string="true"` marks a VALUE that is the parameter's text as is, `string="false"` a JSON value.
`｜DSML｜` is one special token; the rest of the markup is ordinary text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from ds4.core.tokenizer import DSML

TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_CLOSE = f"</{DSML}parameter>"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"
# A tool's output may itself contain the closing tag; only that literal is escaped (spec §5).
TOOL_RESULT_CLOSE_ESCAPED = "&lt;/tool_result>"

_INVOKE_RE = re.compile(
    rf'<{re.escape(DSML)}invoke name="(?P<name>[^"]*)">(?P<body>.*?){re.escape(INVOKE_CLOSE)}', re.S)
_PARAMETER_RE = re.compile(
    rf'<{re.escape(DSML)}parameter name="(?P<name>[^"]*)" string="(?P<string>true|false)">'
    rf'(?P<value>.*?){re.escape(PARAMETER_CLOSE)}', re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = new_call_id()

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ToolSpec:
    name: str
    description: str
    parameters: dict  # a JSON schema


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def render_tool_calls(calls: list[ToolCall]) -> str:
    """The DSML block of an assistant turn that called `calls` (its leading blank line included)."""
    lines = ["", "", TOOL_CALLS_OPEN]
    for call in calls:
        lines.append(f'<{DSML}invoke name="{call.name}">')
        for key, value in call.arguments.items():
            if isinstance(value, str):
                lines.append(f'<{DSML}parameter name="{key}" string="true">{value}{PARAMETER_CLOSE}')
            else:
                text = json.dumps(value, ensure_ascii=False)
                lines.append(f'<{DSML}parameter name="{key}" string="false">{text}{PARAMETER_CLOSE}')
        lines.append(INVOKE_CLOSE)
    lines.append(TOOL_CALLS_CLOSE)
    return "\n".join(lines)


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the answer before the markup, the calls it makes). Text without a tool_calls block comes
    back whole with no calls; an unclosed block (the reply was cut off) is parsed as far as its
    invokes are complete."""
    start = text.find(TOOL_CALLS_OPEN)
    if start < 0:
        return text, []
    answer = text[:start].rstrip("\n")
    end = text.find(TOOL_CALLS_CLOSE, start)
    block = text[start + len(TOOL_CALLS_OPEN):end if end >= 0 else len(text)]
    calls = []
    for m in _INVOKE_RE.finditer(block):
        args = {}
        for p in _PARAMETER_RE.finditer(m.group("body")):
            value = p.group("value")
            if p.group("string") == "false":
                try:
                    value = json.loads(value)
                except ValueError:
                    pass  # a malformed JSON value is passed on as its text
            args[p.group("name")] = value
        calls.append(ToolCall(m.group("name"), args))
    return answer, calls


def render_tool_prompt(tools: list[ToolSpec], choice: str | None = None) -> str:
    """The system text that tells the model its tools and the markup to call them with.
    `choice`: None (the model decides), "required" (at least one call), or a tool's name."""
    schemas = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                    "parameters": t.parameters}, ensure_ascii=False)
                        for t in tools)
    example = render_tool_calls([ToolCall("TOOL_NAME", {"KEY": "VALUE"}, id="-")]).strip("\n")
    text = (
        "## Tools\n\n"
        "These tools are available. To call one or more of them, end the reply with one block "
        "of this form:\n\n"
        f"{example}\n\n"
        'A parameter with string="true" holds its text as is; with string="false" it holds a '
        "JSON value (number, boolean, null, array or object). The results come back in the "
        f"next user turn, each in {TOOL_RESULT_OPEN}...{TOOL_RESULT_CLOSE}.\n\n"
        "### Tool schemas\n\n"
        f"{schemas}")
    if choice == "required":
        text += "\n\nCall at least one tool in this reply."
    elif choice:
        text += f"\n\nCall the tool {choice} in this reply."
    return text


def render_tool_result(content: str) -> str:
    return TOOL_RESULT_OPEN + content.replace(TOOL_RESULT_CLOSE, TOOL_RESULT_CLOSE_ESCAPED) + TOOL_RESULT_CLOSE
