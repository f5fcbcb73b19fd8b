"""The OpenAI API: GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions.

Extensions: `top_k` and `min_p` (ds4's sampler; min_p defaults to ds4's 0.05), and the think
mode: DS4 thinks by default, as `ds4 generate` does; `reasoning_effort: "none"` (or
`"thinking": {"type": "disabled"}`) answers without reasoning, "max" / "xhigh" is Think-Max
where the context allows it. The reasoning comes back apart from the answer, as
`reasoning_content`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ds4.core.sampling import SamplingParams

from .driver import Failed, Finished, GenRequest, Token
from .prompt import Conversation, Turn, add_turn
from .reply import CONTENT, REASONING
from .shared import (MAX_SEED, MAX_TOP_LOGPROBS, MIN_SEED, APIError, ServerState, api_sampling, bad,
                     check_prompt, check_request_text, check_text, encode_prompt, engine_seed, events,
                     first_event, got, max_tokens_for, parse, stops_from, submit)
from .tools import ToolCall, ToolSpec

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP = 4  # OpenAI's API takes "up to 4 sequences" in `stop`, and refuses more
MAX_COMPLETION_LOGPROBS = 5
THINK_OFF = ("none",)
THINK_MAX = ("max", "xhigh")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    max_tokens: Optional[int] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: Union[str, list[str], None] = None
    n: int = 1
    # OpenAI's fields this server does not act on: refused unless they ask for nothing
    # (check_unsupported), rather than accepted and silently ignored
    response_format: Optional[dict[str, Any]] = None
    logit_bias: Optional[dict[str, Any]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        # as OpenAI's API: an optional field sent as null has its default (the official clients
        # send null for an argument given as None)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}
        return data

    def sampling(self) -> SamplingParams:
        return api_sampling(self.temperature, self.top_k, self.top_p, self.min_p)

    def check_unsupported(self) -> None:
        """Refuse what this server would otherwise ignore: more than one choice, a JSON or
        schema response format, logit biases, penalties."""
        if self.n != 1:
            raise bad("n", f"this server returns one choice per request: expected 1, got {self.n}")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise bad("response_format", f"this server has no constrained output: expected type "
                                         f"\"text\", got {got(kind)}")
        if self.logit_bias:
            raise bad("logit_bias", f"this server applies no logit biases: expected none, got "
                                    f"{len(self.logit_bias)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise bad(name, f"this server applies no penalties: expected 0, got {getattr(self, name)}")
        if self.stream_options is not None and not self.stream:  # (as OpenAI refuses it)
            raise bad("stream_options", "only allowed when stream is true")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.get("include_usage"))


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict, None] = None
    reasoning_effort: Optional[str] = None
    thinking: Optional[dict] = None

    def check_unsupported(self) -> None:
        """Also refuse the chat fields this server would ignore: the legacy functions (tools
        take their place), audio, predicted outputs, web search, one tool call at most; and a
        tool_choice without tools, as OpenAI does."""
        super().check_unsupported()
        extra = self.model_extra or {}
        for name, instead in (("functions", "tools"), ("function_call", "tool_choice")):
            if extra.get(name) is not None:
                raise bad(name, f"this server takes {instead}, not the deprecated {name}: expected none")
        for name in ("audio", "prediction", "web_search_options"):
            if extra.get(name) is not None:
                raise bad(name, f"this server does not do {name.replace('_', ' ')}: expected none, "
                                f"got {got(extra[name])}")
        modalities = extra.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise bad("modalities", f"this server answers in text: expected [\"text\"], got {got(modalities)}")
        if extra.get("parallel_tool_calls") is False:
            raise bad("parallel_tool_calls", "this server cannot hold a reply to one tool call: "
                                             "expected true, got false")
        if self.tool_choice is not None and not self.tools:
            raise bad("tool_choice", "only allowed when tools are specified")


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int = 1
    suffix: Optional[str] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of != 1:
            raise bad("best_of", f"this server returns one completion per request: expected 1, got "
                                 f"{self.best_of}")
        if self.suffix:
            raise bad("suffix", "this server does not insert text: expected none")


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str


class _ToolChoice(BaseModel):
    """A tool_choice that names the function to call."""
    model_config = ConfigDict(extra="allow", strict=True)

    type: str = "function"
    function: _FunctionName


# ---- messages -> Conversation ---------------------------------------------------------------------

def _text(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{param}[{j}].type", f"only text content is supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise bad(f"{param}[{j}].text", f"expected a string, got {got(part.get('text'))}")
            out.append(part["text"])
        return "".join(out)
    raise bad(param, f"expected a string or a list of content parts, got {got(content)}")


def _tool_calls(calls, param: str) -> list[ToolCall]:
    if not isinstance(calls, list):
        raise bad(param, "expected a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{param}[{j}].function.name",
                      f"expected a string, got {got(fn.get('name') if isinstance(fn, dict) else fn)}")
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise bad(f"{param}[{j}].function.arguments", "expected a JSON object") from None
        if not isinstance(args, dict):
            raise bad(f"{param}[{j}].function.arguments", "expected a JSON object")
        out.append(ToolCall(fn["name"], args, id=str(call.get("id") or "")))
    return out


def conversation(req: ChatRequest) -> Conversation:
    conv = Conversation()
    for i, msg in enumerate(req.messages):
        p = f"messages[{i}]"
        role = msg.get("role")
        if role in ("system", "developer"):
            conv.system.append(_text(msg.get("content"), f"{p}.content"))
        elif role == "user":
            add_turn(conv, Turn("user", _text(msg.get("content"), f"{p}.content")))
        elif role == "assistant":
            calls = _tool_calls(msg["tool_calls"], f"{p}.tool_calls") if msg.get("tool_calls") else []
            reasoning = msg.get("reasoning_content")
            add_turn(conv, Turn("assistant", _text(msg.get("content"), f"{p}.content"),
                                reasoning if isinstance(reasoning, str) else None, calls))
        elif role in ("tool", "function"):
            add_turn(conv, Turn("tool", tool_results=[_text(msg.get("content"), f"{p}.content")]))
        else:
            raise bad(f"{p}.role", "expected one of system, developer, user, assistant, tool, "
                                   f"function, got {role!r}")
    specs = []
    for j, tool in enumerate(req.tools or ()):  # (checked whatever tool_choice says)
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad(f"tools[{j}].function.name", "expected a function tool with a name")
        specs.append(ToolSpec(fn["name"], fn.get("description") or "",
                              fn.get("parameters") or {"type": "object", "properties": {}}))
    if req.tools and req.tool_choice != "none":
        conv.tools.extend(specs)
        choice = req.tool_choice
        if choice in (None, "auto"):
            conv.tool_choice = None
        elif choice == "required":
            conv.tool_choice = "required"
        elif isinstance(choice, dict) and "function" in choice:
            name = parse(_ToolChoice, choice, "tool_choice").function.name
            if name not in {t.name for t in conv.tools}:
                raise bad("tool_choice.function.name", f"no tool named {name!r} in tools")
            conv.tool_choice = name
        else:
            raise bad("tool_choice", f"expected none, auto, required or a function, got {choice!r}")
    return conv


def think_mode(req: ChatRequest) -> tuple[bool, bool]:
    if req.thinking is not None and req.thinking.get("type") == "disabled":
        return False, False
    effort = req.reasoning_effort
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high", *THINK_MAX):
        raise bad("reasoning_effort", f"expected none, minimal, low, medium, high or max, got {effort!r}")
    return effort not in THINK_OFF, effort in THINK_MAX


# ---- responses ------------------------------------------------------------------------------------

def _usage(fin: Finished) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _finish_reason(fin: Finished) -> str:
    return fin.reason if fin.reason in ("stop", "length", "tool_calls") else "stop"


def _token_entry(tok, token_id: int, logprob: float) -> dict:
    raw = tok.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def _chat_logprob(tok, lp: dict) -> dict:
    entry = _token_entry(tok, lp["id"], lp["logprob"])
    entry["top_logprobs"] = [_token_entry(tok, i, v) for i, v in lp["top"]]
    return entry


class _HeldLogprobs:
    """Logprob entries that go out with their tokens' text. A token whose text the reply holds
    back (a possible stop string, the start of a character, trailing newlines) keeps its entry
    until that text is released; the entries of text that never is (a matched stop string) are
    dropped, so that the entries line up with the returned content."""

    def __init__(self, entry=lambda lp: lp):
        self.entry, self.pending = entry, []

    def add(self, lp: dict | None, channel: str | None = CONTENT) -> None:
        if lp and channel == CONTENT:
            self.pending.append(self.entry(lp))

    def release(self, pieces) -> list:
        """The held entries once pieces carry answer text (else none)."""
        if not any(ch == CONTENT and text for ch, text in pieces):
            return []
        out, self.pending = self.pending, []
        return out


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments_json}}
    if index is not None:
        out["index"] = index
    return out


def chat_completion(fin: Finished, *, model: str, logprobs: list | None, cid: str | None = None,
                    created: int | None = None) -> dict:
    """The non-streamed chat.completion object of a finished generation."""
    message: dict = {"role": "assistant", "content": fin.text[CONTENT]}
    if fin.text[REASONING]:
        message["reasoning_content"] = fin.text[REASONING]
    if fin.tool_calls:
        message["tool_calls"] = [_tool_call_json(c) for c in fin.tool_calls]
        message["content"] = fin.text[CONTENT] or None
    return {"id": cid or "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion",
            "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": None if logprobs is None else {"content": logprobs},
                         "finish_reason": _finish_reason(fin)}],
            "usage": _usage(fin)}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_json(message: str, kind: str = "api_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


async def chat_chunks(evs, *, tok, cid: str, created: int, model: str, logprobs: bool,
                      include_usage: bool):
    """The SSE lines of a streamed chat completion, from a job's events after `Started`."""

    def chunk(delta: dict, finish=None, logprobs=None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [choice]})

    held = _HeldLogprobs(lambda lp: _chat_logprob(tok, lp))

    def pieces(pcs, lp=None, channel=None):
        held.add(lp, channel)
        for ch, text in pcs:
            key = "content" if ch == CONTENT else "reasoning_content"
            lps = held.release([(ch, text)]) if ch == CONTENT else []
            yield chunk({key: text}, logprobs={"content": lps} if lps else None)

    yield chunk({"role": "assistant", "content": ""})
    async for ev in evs:
        if isinstance(ev, Token):
            for c in pieces(ev.pieces, ev.logprob if logprobs else None, ev.channel):
                yield c
        elif isinstance(ev, Failed):
            yield _sse(_error_json(ev.message))
            return
        elif isinstance(ev, Finished):
            for c in pieces(ev.pieces):
                yield c
            if ev.tool_calls:
                yield chunk({"tool_calls": [_tool_call_json(c, i) for i, c in enumerate(ev.tool_calls)]})
            yield chunk({}, _finish_reason(ev))
            if include_usage:
                yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [], "usage": _usage(ev)})
            yield "data: [DONE]\n\n"


def register(app: FastAPI, state: ServerState) -> None:
    tok = state.tokenizer

    def model_object() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "ds4"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if model != state.model_id:
            raise APIError(404, f"model: no model {model!r}; this server serves {state.model_id!r}", "model")
        return model_object()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_request_text(body)
        body.check_unsupported()
        stops = stops_from(body.stop, "stop", MAX_STOP, "OpenAI's limit")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        think, think_max = think_mode(body)
        conv = conversation(body)
        prompt = await encode_prompt(state, conv, think, think_max)
        check_prompt(state, prompt, "messages")
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        n = max_tokens_for(state, requested, limit_param, None, len(prompt))
        want_lp = body.top_logprobs or 0 if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        req = GenRequest(prompt, n, body.sampling(), engine_seed(body.seed), think=think,
                         stops=stops, tools=bool(conv.tools), logprobs=want_lp)
        job = submit(state, req)
        await first_event(job, request)
        model = body.model or state.model_id
        cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        if not body.stream:
            logprobs = [] if want_lp is not None else None
            held = _HeldLogprobs(lambda lp: _chat_logprob(tok, lp))
            async for ev in events(job, request):
                if isinstance(ev, Token) and logprobs is not None:
                    held.add(ev.logprob, ev.channel)
                    logprobs += held.release(ev.pieces)
                elif isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, None, "api_error")
                elif isinstance(ev, Finished):
                    if logprobs is not None:
                        logprobs += held.release(ev.pieces)
                    return chat_completion(ev, model=model, logprobs=logprobs, cid=cid, created=created)
            raise APIError(499, "the client closed the request")

        stream = chat_chunks(events(job, request, stream=True), tok=tok, cid=cid, created=created,
                             model=model, logprobs=want_lp is not None, include_usage=body.include_usage)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request_text(body)
        body.check_unsupported()
        stops = stops_from(body.stop, "stop", MAX_STOP, "OpenAI's limit")
        if body.echo:
            raise bad("echo", "echo is not supported")
        p = body.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise bad("prompt", f"expected one prompt, got {len(p)}")
            p = p[0]
        if isinstance(p, str):
            # (longest_token counts the special tokens' text too: chat markup in `p` is bounded)
            check_text(state, len(p), "prompt")
            # raw text: chat markup in it becomes special tokens; on a worker thread, as encode_prompt
            prompt = await asyncio.to_thread(tok.encode_rendered, p)
        else:
            prompt = [int(x) for x in p]
            bad_ids = [x for x in prompt if not 0 <= x < tok.vocab_size]
            if bad_ids:
                raise bad("prompt", f"token id {bad_ids[0]} is outside the vocabulary "
                                    f"[0, {tok.vocab_size})")
        check_prompt(state, prompt, "prompt")
        n = max_tokens_for(state, body.max_tokens, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS,
                           len(prompt))
        req = GenRequest(prompt, n, body.sampling(), engine_seed(body.seed),
                         stops=stops, logprobs=body.logprobs)
        job = submit(state, req)
        await first_event(job, request)
        model = body.model or state.model_id
        cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())

        def lp_json(lps: list[dict], start: int = 0) -> dict | None:
            """OpenAI's legacy logprobs of lps, text_offset counting characters of the returned
            text from start (the characters sent before these tokens)."""
            if body.logprobs is None:
                return None
            tokens = [tok.token_bytes(x["id"]).decode("utf-8", errors="replace") for x in lps]
            return {"tokens": tokens, "token_logprobs": [x["logprob"] for x in lps],
                    "top_logprobs": [{tok.token_bytes(i).decode("utf-8", errors="replace"): v
                                      for i, v in x["top"]} for x in lps],
                    "text_offset": [start + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]}

        held = _HeldLogprobs()  # (an entry goes out with its token's text, as in a chat)
        if not body.stream:
            lps: list[dict] = []
            async for ev in events(job, request):
                if isinstance(ev, Token):
                    held.add(ev.logprob)
                    lps += held.release(ev.pieces)
                elif isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, None, "api_error")
                elif isinstance(ev, Finished):
                    lps += held.release(ev.pieces)
                    return {"id": cid, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": 0, "text": ev.text[CONTENT], "logprobs": lp_json(lps),
                                         "finish_reason": _finish_reason(ev)}],
                            "usage": _usage(ev)}
            raise APIError(499, "the client closed the request")

        def chunk(text: str, finish=None, lps=None) -> str:
            return _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": 0, "text": text, "logprobs": lps,
                                      "finish_reason": finish}]})

        async def stream():
            sent = 0  # characters of text sent
            async for ev in events(job, request, stream=True):
                if isinstance(ev, Token):
                    text = "".join(t for _, t in ev.pieces)
                    held.add(ev.logprob)
                    lps = held.release(ev.pieces)
                    if text:
                        yield chunk(text, lps=lp_json(lps, sent) if lps else None)
                        sent += len(text)
                elif isinstance(ev, Failed):
                    yield _sse(_error_json(ev.message))
                    return
                elif isinstance(ev, Finished):
                    lps = held.release(ev.pieces)
                    yield chunk("".join(t for _, t in ev.pieces), _finish_reason(ev),
                                lps=lp_json(lps, sent) if lps else None)
                    if body.include_usage:
                        yield _sse({"id": cid, "object": "text_completion", "created": created,
                                    "model": model, "choices": [], "usage": _usage(ev)})
                    yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
