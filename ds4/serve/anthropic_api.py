"""The Anthropic Messages API: POST /v1/messages (streamed or not), POST /v1/messages/count_tokens.

The think mode follows `thinking`: {"type": "enabled", ...} thinks (the reasoning comes back as a
thinking block), anything else answers without reasoning. `top_k` and `top_p` go to ds4's
sampler; min_p stays at ds4's default unless the extension field `min_p` is given. A last
assistant message is the start of the reply (a prefill): the answer continues it, without
repeating it.
Usage: `input_tokens` counts the prompt tokens prefilled for this request, and
`cache_read_input_tokens` those reused from the live session (their sum is the prompt's size).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .driver import Failed, Finished, GenRequest, Token
from .prompt import Conversation, Turn, add_turn
from .reply import CONTENT, REASONING
from .shared import (APIError, ServerState, api_sampling, bad, check_prompt, check_request_text,
                     encode_conversation, encode_prompt, engine_seed, events, first_event, got,
                     max_tokens_for, parse, stops_from, submit)
from .tools import ToolCall, ToolSpec, new_call_id

# Anthropic documents no limit on stop_sequences; this server's own bound keeps the work of
# matching every one against each token's text small
MAX_STOP_SEQUENCES = 16


class _ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None  # (true is refused: see conversation)


class _Prompt(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[_ToolChoice] = None
    thinking: Optional[dict[str, Any]] = None

    @property
    def tools_on(self) -> bool:
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.type != "none")


class MessagesRequest(_Prompt):
    max_tokens: int
    stop_sequences: Optional[list[str]] = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=0)
    stream: bool = False


# The content blocks read here, each type's fields as the prompt uses them (a block of another
# type has only its type checked; where it is refused is the turn's to say).

class _Block(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # (cache_control, citations, signature, ...)

    type: str


class _Text(_Block):
    text: str


class _Thinking(_Block):
    thinking: str


class _ToolUse(_Block):
    id: Optional[str] = None
    name: str
    input: dict[str, Any] = {}


class _ToolResult(_Block):
    content: Any = ""  # a string or content blocks: _blocks reads it, naming its path
    is_error: Optional[bool] = None


_BLOCKS = {"text": _Text, "thinking": _Thinking, "tool_use": _ToolUse, "tool_result": _ToolResult}


def _blocks(content, param: str) -> list[_Block]:
    if isinstance(content, str):
        return [_Text(type="text", text=content)]
    if not isinstance(content, list):
        raise bad(param, f"expected a string or a list of content blocks, got {got(content)}")
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{param}[{j}]", f"expected a content block with a type, got {got(block)}")
        out.append(parse(_BLOCKS.get(block["type"], _Block), block, f"{param}[{j}]"))
    return out


def _text(blocks: list[_Block]) -> str:
    return "".join(b.text for b in blocks if isinstance(b, _Text))


def _result_text(block: _ToolResult, param: str) -> str:
    blocks = _blocks(block.content, f"{param}.content")
    for j, b in enumerate(blocks):  # (an image in a result was dropped without a word)
        if not isinstance(b, _Text):
            raise bad(f"{param}.content[{j}].type", f"expected text in a tool result (this server reads "
                                                    f"text only), got {b.type!r}")
    text = _text(blocks)
    return ("[error] " + text) if block.is_error else text


def conversation(req: _Prompt) -> Conversation:
    conv = Conversation()
    if req.system:
        conv.system.append(_text(_blocks(req.system, "system")))
    for i, msg in enumerate(req.messages):
        p = f"messages[{i}]"
        role = msg.get("role")
        blocks = _blocks(msg.get("content"), f"{p}.content")
        if role == "user":
            results, texts = [], []
            for j, b in enumerate(blocks):
                if isinstance(b, _Text):
                    texts.append(b.text)
                elif isinstance(b, _ToolResult):
                    results.append(_result_text(b, f"{p}.content[{j}]"))
                else:
                    raise bad(f"{p}.content[{j}].type",
                              f"expected text or tool_result in a user turn, got {b.type!r}")
            add_turn(conv, Turn("tool", "".join(texts), tool_results=results) if results
                     else Turn("user", "".join(texts)))
        elif role == "assistant":
            text, reasoning, calls = [], [], []
            for j, b in enumerate(blocks):
                if isinstance(b, _Text):
                    text.append(b.text)
                elif isinstance(b, _Thinking):
                    reasoning.append(b.thinking)
                elif b.type == "redacted_thinking":
                    continue
                elif isinstance(b, _ToolUse):
                    calls.append(ToolCall(b.name, b.input, id=b.id or ""))
                else:
                    raise bad(f"{p}.content[{j}].type",
                              f"expected text, thinking or tool_use in an assistant turn, got {b.type!r}")
            add_turn(conv, Turn("assistant", "".join(text), "".join(reasoning) if reasoning else None, calls))
        else:
            raise bad(f"{p}.role", f"expected user or assistant, got {role!r}")
    # a last assistant message is the start of the reply, which the answer continues
    conv.continue_last = bool(conv.turns) and conv.turns[-1].role == "assistant" and not conv.turns[-1].tool_calls
    if req.tool_choice is not None and not req.tools:
        raise bad("tool_choice", "tool_choice may only be specified while providing tools")
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        # (as the OpenAI API's parallel_tool_calls false: the model may call several tools in a
        # reply, and the server would not cut it to one)
        raise bad("tool_choice.disable_parallel_tool_use", "this server cannot hold a reply to one "
                                                            "tool call: expected false, got true")
    specs = []
    for j, tool in enumerate(req.tools or ()):  # (checked whatever tool_choice says)
        if not isinstance(tool.get("name"), str):
            raise bad(f"tools[{j}].name", f"expected a string, got {got(tool.get('name'))}")
        specs.append(ToolSpec(tool["name"], tool.get("description") or "",
                              tool.get("input_schema") or {"type": "object", "properties": {}}))
    if req.tool_choice is not None and req.tool_choice.type not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type", f"expected auto, any, tool or none, got {req.tool_choice.type!r}")
    if req.tools_on:
        conv.tools.extend(specs)
        choice = req.tool_choice or _ToolChoice(type="auto")
        kind = choice.type
        if kind == "any":
            conv.tool_choice = "required"
        elif kind == "tool":
            if choice.name not in {t.name for t in conv.tools}:
                raise bad("tool_choice.name", f"no tool named {choice.name!r} in tools")
            conv.tool_choice = choice.name
        elif kind != "auto":
            raise bad("tool_choice.type", f"expected auto, any, tool or none, got {kind!r}")
    return conv


def _think(req: _Prompt) -> bool:
    kind = (req.thinking or {}).get("type")
    if kind not in (None, "enabled", "disabled", "adaptive"):
        raise bad("thinking.type", f"expected enabled or disabled, got {kind!r}")
    return kind in ("enabled", "adaptive")


def _stop_reason(fin: Finished) -> str:
    if fin.reason == "tool_calls":
        return "tool_use"
    if fin.reason == "length":
        return "max_tokens"
    return "stop_sequence" if fin.stop_sequence is not None else "end_turn"


def _usage(prompt_tokens: int, cached: int, output: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": _anthropic_id(call), "name": call.name, "input": call.arguments}


def _anthropic_id(call: ToolCall) -> str:
    if not call.id.startswith("toolu_"):
        call.id = new_call_id("toolu_")
    return call.id


def message(fin: Finished, *, model: str, mid: str | None = None) -> dict:
    content = []
    if fin.text[REASONING]:
        content.append({"type": "thinking", "thinking": fin.text[REASONING], "signature": ""})
    # (as message_events streams it: a text block holds text, and an empty reply is one empty
    # text block; a reply cut while thinking is its thinking block alone)
    if fin.text[CONTENT] or not (content or fin.tool_calls):
        content.append({"type": "text", "text": fin.text[CONTENT]})
    content += [_tool_use(c) for c in fin.tool_calls]
    return {"id": mid or "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": _stop_reason(fin),
            "stop_sequence": fin.stop_sequence,
            "usage": _usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def message_events(evs, started, *, model: str, mid: str):
    """The SSE events of a streamed message, from a job's `Started` and its later events."""
    yield _event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": _usage(started.prompt_tokens, started.cached_tokens, 0)}})
    index, open_kind = -1, None

    def deltas(pieces):
        nonlocal index, open_kind
        for ch, text in pieces:
            kind = "thinking" if ch == REASONING else "text"
            if kind != open_kind:
                if open_kind is not None:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
                open_kind = kind
                block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                    else {"type": "text", "text": ""}
                yield _event("content_block_start", {"type": "content_block_start",
                                                     "index": index, "content_block": block})
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" \
                else {"type": "text_delta", "text": text}
            yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": delta})

    async for ev in evs:
        if isinstance(ev, Token):
            for e in deltas(ev.pieces):
                yield e
        elif isinstance(ev, Failed):
            yield _event("error", {"type": "error", "error": {"type": "api_error",
                                                              "message": ev.message}})
            return
        elif isinstance(ev, Finished):
            for e in deltas(ev.pieces):
                yield e
            if open_kind is None and not ev.tool_calls:  # an empty answer is one empty text block
                for e in deltas([(CONTENT, "")]):
                    yield e
            if open_kind is not None:
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            for call in ev.tool_calls:
                index += 1
                block = {**_tool_use(call), "input": {}}
                yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": block})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                     "delta": {"type": "input_json_delta",
                                                               "partial_json": call.arguments_json}})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": _stop_reason(ev),
                                                     "stop_sequence": ev.stop_sequence},
                                           "usage": {"output_tokens": ev.completion_tokens}})
            yield _event("message_stop", {"type": "message_stop"})


def register(app: FastAPI, state: ServerState) -> None:

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: _Prompt) -> dict:
        check_request_text(body)
        # (off the loop as encode_prompt, but any length: the count is the answer, not a prompt)
        prompt = await asyncio.to_thread(encode_conversation, state, conversation(body), _think(body))
        return {"input_tokens": len(prompt)}

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        check_request_text(body)
        stops = stops_from(body.stop_sequences, "stop_sequences", MAX_STOP_SEQUENCES, "this server's limit")
        think = _think(body)
        conv = conversation(body)
        prompt = await encode_prompt(state, conv, think)
        # (max_tokens is always given: a prompt that fills the context is too long with it, in
        # Anthropic's words, rather than on its own)
        check_prompt(state, prompt, "messages", most=state.ctx)
        n = max_tokens_for(state, body.max_tokens, "max_tokens", None, len(prompt))
        params = api_sampling(body.temperature, body.top_k, body.top_p, body.min_p)
        # (a continued reply is past its thinking: the prefilled turn closed it)
        req = GenRequest(prompt, n, params, engine_seed(body.seed), think=think and not conv.continue_last,
                         stops=stops, tools=body.tools_on)
        job = submit(state, req)
        started = await first_event(job, request)
        model = body.model or state.model_id
        mid = "msg_" + secrets.token_hex(12)
        if not body.stream:
            async for ev in events(job, request):
                if isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, None, "api_error")
                if isinstance(ev, Finished):
                    return message(ev, model=model, mid=mid)
            raise APIError(499, "the client closed the request")

        stream = message_events(events(job, request, stream=True), started, model=model, mid=mid)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
