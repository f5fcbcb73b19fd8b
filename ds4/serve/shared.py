"""What both APIs share: the server's state, request errors, limits, running a job."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ds4.core.chat import THINK_MAX_MIN_CONTEXT, encode_parts

from .driver import Driver, Failed, Finished, GenRequest, Job, QueueFull, Started, next_event
from .prompt import Conversation, conversation_parts

MAX_SEED = (1 << 64) - 1
MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """A request the server refuses; rendered in the calling API's own error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


@dataclass
class ServerState:
    driver: Driver
    model_id: str
    max_tokens_limit: int
    created: int

    @property
    def tokenizer(self):
        return self.driver.tokenizer

    @property
    def ctx(self) -> int:
        return self.driver.ctx


def encode_conversation(state: ServerState, conv: Conversation, think: bool,
                        think_max: bool = False) -> list[int]:
    think_max = think_max and state.ctx >= THINK_MAX_MIN_CONTEXT  # as ds4: MAX needs the room
    return encode_parts(state.tokenizer, conversation_parts(conv, think=think, think_max=think_max))


def check_prompt(state: ServerState, prompt: list[int], param: str) -> None:
    if not prompt:
        raise bad(param, "the prompt is empty")
    if len(prompt) >= state.ctx:
        raise bad(param, f"the prompt has {len(prompt)} tokens, which leaves no room in the "
                         f"server's context of {state.ctx} tokens")


def max_tokens_for(state: ServerState, requested: int | None, param: str, default: int | None,
                   prompt_len: int) -> int:
    room = state.ctx - prompt_len
    if requested is None:
        return min(room, state.max_tokens_limit) if default is None else min(default, room)
    if requested < 1:
        raise bad(param, f"expected an integer >= 1, got {requested}")
    if requested > state.max_tokens_limit:
        raise bad(param, f"expected at most {state.max_tokens_limit} (the server's limit), "
                         f"got {requested}")
    return min(requested, room)


def stops_from(value, param: str) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else list(value)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad(param, f"expected at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
    return [s for s in stops if s]


def default_seed() -> int:
    return time.time_ns() & MAX_SEED


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
    client goes away or the consumer stops early. A stream (`stream`) does not poll for the
    client: the server closes this iterator when a send to a client that went away fails,
    which happens at the next token."""
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

