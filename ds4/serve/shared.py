"""What both APIs share: the server's state, request errors, limits, running a job."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ds4.core.chat import THINK_MAX_MIN_CONTEXT, Part, encode_parts
from ds4.core.sampling import SamplingParams
from ds4.core.text import check_utf8

from .driver import Driver, Failed, Finished, GenRequest, Job, QueueFull, Started, next_event
from .prompt import Conversation, conversation_parts

MAX_SEED = (1 << 64) - 1
MIN_SEED = -(1 << 63)  # OpenAI's seed is a signed 64-bit integer; the engine takes its 64 bits
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """A request the server refuses; rendered in the calling API's own error JSON (`code`:
    OpenAI's error code, where it has one for this error)."""

    code: str | None = None

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    @property
    def anthropic_message(self) -> str:
        """The message as the Anthropic API words it (the same, unless it has its own wording)."""
        return self.message


class ContextExceeded(APIError):
    """A prompt the context cannot hold, or a prompt and a reply's max_tokens that pass it, in
    each API's wording, which clients look for (to shorten a history, say): OpenAI's code
    context_length_exceeded and "This model's maximum context length is N tokens", with the
    field in `param`; Anthropic's "prompt is too long: P tokens > N maximum" and "input length
    and `max_tokens` exceed context limit: P + M > N". With `chars`, text refused untokenized:
    `prompt` is the least number of tokens that many characters are, a token standing for at
    most `longest` bytes."""

    code = "context_length_exceeded"

    def __init__(self, param: str, ctx: int, prompt: int, requested: int | None = None, *,
                 chars: int | None = None, longest: int | None = None):
        self.ctx, self.prompt, self.requested = ctx, prompt, requested
        self.counted = "" if chars is None else \
            f"the prompt's text has {chars} characters, and a token stands for at most {longest} bytes"
        head = f"This model's maximum context length is {ctx} tokens; "
        if requested is not None:
            message = (head + f"you requested {prompt + requested} tokens ({prompt} in the prompt, "
                              f"{requested} for {param}): {param} may be at most {ctx - prompt}")
        elif chars is not None:
            message = head + (f"the prompt's text has {chars} characters, at least {prompt} tokens (a "
                              f"token stands for at most {longest} bytes): shorten {param}")
        else:
            message = head + (f"the prompt has {prompt} tokens, which leaves no room for a reply: "
                              f"shorten {param}")
        super().__init__(400, message, param)

    @property
    def anthropic_message(self) -> str:
        if self.requested is not None:
            return (f"input length and `max_tokens` exceed context limit: {self.prompt} + "
                    f"{self.requested} > {self.ctx}")
        if self.counted:
            return f"prompt is too long: at least {self.prompt} tokens > {self.ctx} maximum ({self.counted})"
        return f"prompt is too long: {self.prompt} tokens > {self.ctx} maximum"


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


_JSON_TYPES = ((bool, "boolean"), ((int, float), "number"), (str, "string"), ((list, tuple), "array"),
               (dict, "object"))
SHOWN_CHARS = 200  # of a wrong value in an error message


def got(value) -> str:
    """What a client sent, for an error message: its JSON type and (the start of) its JSON."""
    if value is None:
        return "null"
    kind = next((name for t, name in _JSON_TYPES if isinstance(value, t)), type(value).__name__)
    return f"{kind} {json.dumps(value, default=str)[:SHOWN_CHARS]}"


def field_path(loc, prefix: str = "") -> str:
    """pydantic's error location as the field path the messages use: messages[0].content[1].text."""
    out = prefix
    for key in loc:
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else str(key)
    return out


# pydantic names the member of a union it tried as a step of an error's location ("str",
# "list[str]", a model's class name): no field of either API is spelled like one
_UNION_KINDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
                "none": "null", "list": "an array", "dict": "an object"}


def _union_step(key) -> bool:
    return isinstance(key, str) and (key.split("[")[0] in _UNION_KINDS or "[" in key or key[:1].isupper())


def _kind(step: str) -> str:
    return _UNION_KINDS.get(step.split("[")[0], step)


def first_invalid(errors: list[dict], prefix: str = "") -> APIError:
    """The 400 of a validation's errors: the first one's (invalid), where its location runs
    through a union, the union's field itself, with the kinds it takes, unless a member matched
    the value's kind and failed further in (then that error, without the members' names)."""
    first = errors[0]
    loc = list(first.get("loc", ()))
    at = next((i for i, key in enumerate(loc) if _union_step(key)), None)
    if at is None:
        return invalid(first, prefix)
    head = loc[:at]
    members = [e for e in errors if list(e.get("loc", ()))[:at] == head and len(e.get("loc", ())) > at]
    deeper = [e for e in members if len(e["loc"]) > at + 1]
    if deeper:
        e = deeper[0]
        return invalid({**e, "loc": head + [k for k in e["loc"][at:] if not _union_step(k)]}, prefix)
    kinds = list(dict.fromkeys(_kind(e["loc"][at]) for e in members))
    detail = f"expected {' or '.join(kinds)}"
    if "input" in first:
        detail += f", got {got(first['input'])}"
    return bad(field_path(head, prefix) or "body", detail)


def invalid(error: dict, prefix: str = "") -> APIError:
    """A 400 of one of pydantic's errors: the field's path (under `prefix`), what it expects,
    and what came."""
    param = field_path(error.get("loc", ()), prefix) or "body"
    # (pydantic's message for a model names the class: the client knows it as an object)
    detail = "Input should be an object" if error.get("type") == "model_type" \
        else error.get("msg", "invalid value")
    if "input" in error and error.get("type") != "missing":
        detail += f", got {got(error['input'])}"
    return bad(param, detail)


def check_request_text(body: BaseModel) -> None:
    """Refuse a request any of whose strings (a key of an object included) UTF-8 cannot encode,
    with a 400 naming the first one's field. JSON may carry a lone surrogate escaped ("\\ud800"),
    which is no character: the tokenizer would fail on it (an unhandled 500), and so would the
    JSON of a reply that echoes it (the model, a tool call's arguments). Every field is looked
    at, once, before any is read, so that each API's text fields need no check of their own."""
    def walk(value, path: str) -> None:
        if isinstance(value, str):
            check(value, path, path)
            return
        # (an object's keys before its values: a key names the path of what it holds)
        items = value.items() if isinstance(value, dict) else value if isinstance(value, BaseModel) \
            else enumerate(value) if isinstance(value, (list, tuple)) else ()
        for key, item in items:  # (a model's fields and any extra ones)
            if isinstance(key, str):
                check(key, f"{path or 'body'}: a key", path or "body")
            walk(item, field_path([key], path))

    def check(text: str, what: str, param: str) -> None:
        try:
            check_utf8(text, what)
        except ValueError as e:
            raise APIError(400, str(e), param) from None

    walk(body, "")


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], value, param: str) -> M:
    """`value` (a part of a request at `param`) as `model`, or the 400 of the first field that
    does not fit."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise first_invalid(e.errors(), param) from None


@dataclass
class ServerState:
    driver: Driver
    model_id: str
    max_tokens_limit: int
    created: int
    # the most bytes one token stands for (a text character is one byte or more); see check_text
    longest_token: int = field(init=False)

    def __post_init__(self):
        tok = self.tokenizer
        self.longest_token = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))

    @property
    def tokenizer(self):
        return self.driver.tokenizer

    @property
    def ctx(self) -> int:
        return self.driver.ctx


def _parts(state: ServerState, conv: Conversation, think: bool, think_max: bool) -> list[Part]:
    think_max = think_max and state.ctx >= THINK_MAX_MIN_CONTEXT  # as ds4: MAX needs the room
    return conversation_parts(conv, think=think, think_max=think_max)


def encode_conversation(state: ServerState, conv: Conversation, think: bool,
                        think_max: bool = False) -> list[int]:
    return encode_parts(state.tokenizer, _parts(state, conv, think, think_max))


async def encode_prompt(state: ServerState, conv: Conversation, think: bool, think_max: bool = False,
                        param: str = "messages") -> list[int]:
    """The prompt's ids, after refusing text that cannot fit (check_text), tokenized on a worker
    thread rather than the event loop's (Tokenizer.encode lets go of the GIL while it works)."""
    parts = _parts(state, conv, think, think_max)
    check_text(state, sum(len(text) for special, text in parts if not special), param)
    return await asyncio.to_thread(encode_parts, state.tokenizer, parts)


def check_text(state: ServerState, chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt whose text cannot fit the context whatever its
    tokens. Each token stands for at most `longest_token` bytes of text, and a character is one
    byte or more: text of `chars` characters is at least chars / longest_token tokens. Text of
    more than ctx * longest_token characters is more tokens than the whole context, and only
    such plainly too long text is refused here; check_prompt counts the tokens of the rest."""
    longest = state.longest_token
    if chars > state.ctx * longest:
        raise ContextExceeded(param, state.ctx, -(-chars // longest), chars=chars, longest=longest)


def check_prompt(state: ServerState, prompt: list[int], param: str, most: int | None = None) -> None:
    """Refuse an empty prompt, or one of more than `most` tokens (by default ctx - 1: the reply
    needs one token of the context at least; an API whose max_tokens is always given may pass
    ctx and leave a prompt that fills the context to max_tokens_for)."""
    if not prompt:
        raise bad(param, "the prompt is empty")
    if len(prompt) > (state.ctx - 1 if most is None else most):
        raise ContextExceeded(param, state.ctx, len(prompt))


def max_tokens_for(state: ServerState, requested: int | None, param: str, default: int | None,
                   prompt_len: int) -> int:
    """The most tokens a reply may have. A request that asks for none gets the endpoint's
    `default` or, without one, what the context leaves (up to the server's limit), cut to fit.
    One that asks for more than the context leaves after its prompt is refused, as OpenAI and
    Anthropic refuse it, rather than cut short in silence: its client would take a reply ended
    by the context for one ended by its own limit."""
    room = state.ctx - prompt_len
    if requested is None:
        return min(room, state.max_tokens_limit) if default is None else min(default, room)
    if requested < 1:
        raise bad(param, f"expected an integer >= 1, got {requested}")
    if requested > state.max_tokens_limit:
        raise bad(param, f"expected at most {state.max_tokens_limit} (the server's limit), "
                         f"got {requested}")
    if requested > room:
        raise ContextExceeded(param, state.ctx, prompt_len, requested)
    return requested


def stops_from(value, param: str, limit: int, whose: str) -> list[str]:
    """A request's stop strings (a string or a list of them), at most `limit` of them (`whose`
    limit it is, for the error); empty ones match nothing and are dropped."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else list(value)
    if len(stops) > limit:
        raise bad(param, f"expected at most {limit} stop sequences ({whose}), got {len(stops)}")
    return [s for s in stops if s]


def api_sampling(temperature: float, top_k: int, top_p: float, min_p: float) -> SamplingParams:
    """A request's sampling as ds4's. Both APIs take top_p in [0, 1]; ds4 reads a top_p outside
    (0, 1] as off, but the smallest set of tokens holding a mass of at least 0 is the most
    probable one alone, so top_p 0 is greedy (temperature 0: the same token as top_k 1, the
    lowest id among equal maxima, on the engine's greedy path)."""
    if top_p == 0.0:
        return SamplingParams(0.0, top_k, 1.0, min_p)
    return SamplingParams(temperature, top_k, top_p, min_p)


def default_seed() -> int:
    return time.time_ns() & MAX_SEED


def engine_seed(seed: int | None) -> int:
    """The engine's seed of a request's: its 64 bits (a negative seed is as valid as any), or
    the clock's without one."""
    return default_seed() if seed is None else seed & MAX_SEED


def submit(state: ServerState, req: GenRequest) -> Job:
    try:
        return state.driver.submit(req)
    except QueueFull as e:
        raise APIError(429, str(e), None, "rate_limit_error",
                       headers={"Retry-After": str(e.retry_after)}) from None


async def first_event(job: Job, request):
    """Wait for the prefill: `Started`, or raise the job's failure as an APIError (so that a
    stream that cannot start gets a status code, not an error event)."""
    ev = await next_event(job, request)
    if ev is None:
        raise APIError(499, "the client closed the request")
    if isinstance(ev, Failed):
        # (503: each API's own type, which error_response picks; Anthropic's overloaded_error
        # is no OpenAI type)
        raise APIError(ev.status, ev.message, None, None if ev.status == 503 else "api_error")
    assert isinstance(ev, Started), ev
    return ev


async def events(job: Job, request, stream: bool = False) -> AsyncIterator:
    """The job's events after `Started`, up to `Finished` or `Failed`; cancels the job if the
    client goes away or the consumer stops early. A stream (`stream`) does not look for the
    client: Starlette's StreamingResponse listens for the disconnect beside the stream (under
    uvicorn's ASGI 2.3) and cancels it as it comes, which ends this iterator (under a server of
    ASGI 2.4, the next token's send fails instead)."""
    try:
        while True:
            ev = await (job.events.get() if stream else next_event(job, request))
            if ev is None:
                return
            yield ev
            if isinstance(ev, (Finished, Failed)):
                return
    finally:
        job.cancel()

