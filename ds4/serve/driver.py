"""The engine's one generation thread, its bounded queue, prompt reuse and cancellation.

The engine and its session are not thread-safe, so every engine call happens on one thread.
Endpoints `submit` a `GenRequest` and read the job's events (`Started`, `Token`..., then
`Finished` or `Failed`) from an asyncio queue that the thread fills. A job's `cancel()` (the
client went away) and a shutdown (`stop_all`) are seen by the thread before its next token or
prefill piece (STOP_CHECK_TOKENS).

Prompt reuse: the server keeps one live session. A request whose prompt starts with every token
the session holds (its previous prompt and reply: a chat or an agent resending its history)
prefills only the rest; one that starts with the previous prompt less its last token continues
from a snapshot taken there; the reused count is reported as cached tokens. Any other prompt is
prefilled from the start (the compressed caches cannot be rewound, only restored).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ds4.core.graph import chunk_bounds
from ds4.core.sampling import Rng, SamplingParams, sample
from ds4.engine import Session

from .metrics import Metrics
from .reply import ReplyStream
from .tools import ToolCall

log = logging.getLogger("ds4.serve")

# How the average generation's duration is tracked for Retry-After (weight of the newest one).
_DURATION_EMA_WEIGHT = 0.3
# How often a request that is not streamed checks that its client is still there while no
# token comes (seconds); it checks at each token as well.
DISCONNECT_POLL_S = 0.25
# How long shutdown waits for the generation thread to finish its cancelled token (seconds).
CLOSE_WAIT_S = 30.0
# A prompt is prefilled this many tokens at a time (rounded up to whole prefill chunks), looking
# for a shutdown or a client that left in between: each piece costs a sync (its logits, a
# pipeline's frames drained, a tensor-parallel SYNC of the tokens so far).
STOP_CHECK_TOKENS = 8192


@dataclass
class GenRequest:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int
    think: bool = False  # the reply starts in the reasoning channel
    stops: list[str] = field(default_factory=list)
    tools: bool = False  # parse DS4 tool-call markup out of the answer
    logprobs: int | None = None  # None: none; k: the chosen token's and the k best


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Token:
    pieces: list[tuple[str, str]]  # (channel, text) this token completed
    logprob: dict | None  # {"id", "logprob", "top": [(id, logprob), ...]}
    channel: str  # the channel the token belongs to (reasoning, content)


@dataclass
class Finished:
    reason: str  # "stop", "length", "tool_calls" or "cancelled"
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    tool_calls: list[ToolCall]
    pieces: list[tuple[str, str]]  # text held back until the end
    text: dict  # channel -> whole text


@dataclass
class Failed:
    status: int  # the HTTP status it stands for (503: the pipeline is away, 500: a bug)
    message: str


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy; retry in {retry_after} s")
        self.retry_after = retry_after


class Job:
    def __init__(self, req: GenRequest, loop: asyncio.AbstractEventLoop):
        self.req = req
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.on_cancel = None  # (the driver's: a waiting job frees its queue slot at once)

    def put(self, event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()


SHUTTING_DOWN = "the server is shutting down"


class _Interrupted(Exception):
    """A prompt's prefill stopped between two pieces: its client left or the server is stopping."""


def _unavailable_errors() -> tuple[type[BaseException], ...]:
    from ds4.pipeline import PipelineError
    from ds4.tp import TPError

    return (PipelineError, TPError, OSError)


class Driver:
    def __init__(self, engine, *, ctx: int, queue_size: int, metrics: Metrics | None = None,
                 snapshots: bool = True, prefill_cap: int | None = None,
                 stop_check_tokens: int = STOP_CHECK_TOKENS):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.ctx = ctx
        self.queue_size = queue_size
        self.metrics = metrics or Metrics()
        self.session = engine.session(ctx=ctx, prefill_cap=prefill_cap)  # (None: the layout's default)
        self.stop_check_tokens = stop_check_tokens
        self.split = not isinstance(self.session, Session)
        # a pipeline's next stage or a tensor-parallel worker can go away and come back
        self.remote = self.split or hasattr(engine, "ensure_worker")
        # A host copy of the session at the previous prompt less its last token (see
        # _prefill_with_snapshot); it costs one copy of the state per new prompt.
        self.snapshots = snapshots
        self._snapshot = None
        self.available = True  # False while the pipeline's next stage is unreachable
        self._lock = threading.Lock()
        # the jobs the generation thread has not taken yet, in order (None: stop), at most
        # queue_size + 1: a job whose client leaves is taken out (_abandon)
        self._waiting: deque = deque()
        self._wake = threading.Condition(self._lock)
        self._inflight = 0  # submitted and not finished: the one generating plus those waiting
        self._running = 0
        self._current: Job | None = None
        self._avg_seconds = 1.0
        self._stopping = threading.Event()  # the server is shutting down (stop_all)
        # held by the generation thread while it runs a request, and by a /health probe while it
        # looks at the remote end: a tensor-parallel worker's replies to a command in flight
        # would read as its connection closing
        self._engine_lock = threading.Lock()
        self.away_reason = ""  # why the remote end was last found away (for 503s and /health)
        self._thread = threading.Thread(target=self._loop, name="ds4-generate", daemon=True)
        self._thread.start()

    # ---- the endpoints' side ----

    def submit(self, req: GenRequest) -> Job:
        job = Job(req, asyncio.get_running_loop())
        job.on_cancel = lambda: self._abandon(job)
        with self._lock:
            if self._inflight >= self.queue_size + 1:
                self.metrics.rejected.inc()
                raise QueueFull(max(1, math.ceil(self._avg_seconds * self._inflight)))
            self._inflight += 1
            self._waiting.append(job)
            self._set_depth()
            self._wake.notify()
        return job

    def _abandon(self, job: Job) -> None:
        """A job's client left. One still waiting gives its queue slot back now, not when the
        generation thread comes to it (with --queue 1 the next client got 429 meanwhile)."""
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                self._inflight -= 1
                self._set_depth()

    def _set_depth(self) -> None:
        self.metrics.queue_depth.set(self._inflight - self._running)

    def probe(self) -> bool:
        """For /health: whether the pipeline's next stage or the tensor-parallel worker is there.
        Looked at only while no request runs (one that runs reports its own failure): a worker
        that left counts as away, and one that is away is tried again within the engine's probe
        wait."""
        if not self.remote:
            return True
        if not self._engine_lock.acquire(blocking=False):
            return self.available
        try:
            return self._reachable()
        finally:
            self._engine_lock.release()

    @property
    def remote_name(self) -> str:
        return "the pipeline's next stage" if self.split else "the tensor-parallel worker"

    def _reachable(self) -> bool:
        """(holding _engine_lock) Whether the remote end is there, trying to reach it again if not."""
        if self.available and self._worker_gone():
            self.available, self.away_reason = False, "it closed its connection"
        return self.available or self._reconnect()

    def _worker_gone(self) -> bool:
        """Whether a tensor-parallel worker left while idle (call between commands only)."""
        present = getattr(self.engine, "worker_present", None)
        return present is not None and not present()

    def _reconnect(self) -> bool:
        try:
            self.engine.connect()
            self.available = True
        except _unavailable_errors() as e:
            why = str(e) or type(e).__name__
            if why != self.away_reason:  # (once per reason: /health probes every few seconds)
                log.warning("%s is away: %s", self.remote_name, why)
            self.available, self.away_reason = False, why
        return self.available

    def stop_all(self) -> None:
        """The server is shutting down: the generation under way ends at its next token and
        every waiting request at once, each with a 503 its client sees (an error event on a
        stream), so that the open streams close within the grace period instead of being cut."""
        self._stopping.set()

    def close(self) -> None:
        """Stop after the generation under way (cancelled at its next token); waiting requests
        get 503 (stop_all)."""
        self.stop_all()
        current = self._current
        if current is not None:
            current.cancel()
        with self._lock:
            self._waiting.append(None)
            self._wake.notify()
        self._thread.join(timeout=CLOSE_WAIT_S)
        close = getattr(self.engine, "close", None)
        if close:
            close()

    # ---- the generation thread ----

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting:
                    self._wake.wait()
                job = self._waiting.popleft()
                if job is None:
                    return
                self._running = 1
                self._current = job
                self._set_depth()
            t0 = time.perf_counter()
            self.metrics.running.set(1)
            try:
                if job.cancelled.is_set():  # its client left while it waited
                    continue
                if self._stopping.is_set():
                    job.put(Failed(503, SHUTTING_DOWN))
                    continue
                with self._engine_lock:
                    self._run(job)
            except Exception as e:  # a bug: the job fails, the server goes on
                log.exception("generation failed")
                job.put(Failed(500, f"internal error: {type(e).__name__}: {e}"))
                with contextlib.suppress(Exception):
                    self.session.sync([])  # a session in an unknown state is not reused
            finally:
                with self._lock:
                    self._inflight -= 1
                    self._running = 0
                    self._current = None
                    self._set_depth()
                self.metrics.running.set(0)
                if not job.cancelled.is_set():
                    w = _DURATION_EMA_WEIGHT
                    self._avg_seconds = (1 - w) * self._avg_seconds + w * (time.perf_counter() - t0)

    def _run(self, job: Job) -> None:
        req, s, m = job.req, self.session, self.metrics
        if self.remote and not self._reachable():
            # 503 at once, not after the engine's wait for a worker (--tp-wait: minutes)
            job.put(Failed(503, f"{self.remote_name} is away ({self.away_reason}); /health says when "
                                "it is back"))
            return
        prev = s.tokens  # (after the check: a new worker holds none of them)
        req.prompt = same_text_prefix(self.tokenizer, prev, req.prompt)
        n_prompt = len(req.prompt)
        cached = len(prev) if len(prev) <= n_prompt and req.prompt[:len(prev)] == prev else 0
        unavailable = _unavailable_errors()
        try:
            if self.split:
                s.sampling = req.params  # how many candidates the last stage sends back
            t0 = time.perf_counter()
            if self.split or not self.snapshots:
                self._sync(req.prompt, job)
            else:
                cached = self._prefill_with_snapshot(req.prompt, cached, job)
            t_prefill = time.perf_counter() - t0
        except unavailable as e:
            self.available, self.away_reason = False, str(e)
            job.put(Failed(503, str(e)))
            return
        except _Interrupted:
            if job.cancelled.is_set():  # (nobody reads its events any more)
                m.cancelled.inc()
            else:
                job.put(Failed(503, f"{SHUTTING_DOWN}; the prompt stopped after {len(s.tokens)} of its "
                                    f"{n_prompt} tokens"))
            return
        self.available = True
        if n_prompt > cached and t_prefill > 0:
            m.prefill_rate.set((n_prompt - cached) / t_prefill)
        job.put(Started(n_prompt, cached))

        eos = self.tokenizer.eos_id
        reply = ReplyStream(self.tokenizer, think=req.think, stops=req.stops, tools=req.tools)
        # (the endpoint fitted max_tokens to the prompt as the client's text tokenizes; spelled
        # with the session's own tokens (same_text_prefix) it can be longer, and the context
        # still bounds the reply)
        n = min(req.max_tokens, s.ctx - n_prompt)
        generated, reason = 0, None
        steps = self._steps(s, n, req, Rng(req.seed))
        t1 = time.perf_counter()
        try:
            with contextlib.closing(steps):
                for token, logprob in steps:
                    if token == eos:
                        reason = "stop"
                        break
                    generated += 1
                    channel = reply.channel
                    pieces = reply.push(token)
                    if reply.tool_text is not None:
                        channel = "tool"
                    job.put(Token(pieces, logprob, channel))
                    if reply.done:
                        reason = "stop"
                        break
                    if job.cancelled.is_set():
                        reason = "cancelled"
                        m.cancelled.inc()
                        break
                    if self._stopping.is_set():
                        job.put(Failed(503, f"{SHUTTING_DOWN}; the reply stopped after {generated} tokens"))
                        return
        except unavailable as e:
            self.available, self.away_reason = False, str(e)
            job.put(Failed(503, f"the generation stopped after {generated} tokens: {e}"))
            return
        t_decode = time.perf_counter() - t1
        pieces, calls = reply.finish()
        reason = finish_reason(reason, bool(calls))
        m.prompt_tokens.inc(n_prompt)
        m.cached_tokens.inc(cached)
        m.generated_tokens.inc(generated)
        if generated and t_decode > 0:
            m.decode_rate.set(generated / t_decode)
        job.put(Finished(reason, reply.stop_hit, n_prompt, cached, generated, calls, pieces,
                         dict(reply.text)))

    def _sync(self, tokens: list[int], job: Job) -> None:
        """session.sync(tokens) a piece at a time (stop_check_tokens, in whole prefill chunks:
        cut where the session cuts its own), looking before each piece for a job its client left
        or a server shutting down (-> _Interrupted): a long prompt stops within one piece
        instead of running on past the shutdown's grace period. The session then holds a
        prefix of `tokens`, which a later request reuses like any other."""
        s = self.session
        held = s.tokens
        start = len(held) if tokens[:len(held)] == held else 0
        cap = s.layout.prefill_cap
        bounds = chunk_bounds(start, len(tokens), cap * max(1, math.ceil(self.stop_check_tokens / cap)))
        if not bounds:  # the session holds exactly these tokens, or none are asked for
            s.sync(tokens)
        for _, b in bounds:
            if job.cancelled.is_set() or self._stopping.is_set():
                raise _Interrupted
            s.sync(tokens[:b])

    def _prefill_with_snapshot(self, prompt: list[int], cached: int, job: Job) -> int:
        """Sync the session to `prompt`, reusing the longest prefix it can: the tokens the
        session holds, or the snapshot of the previous prompt less its last token. That
        snapshot serves a history that resends the previous prompt but not the reply as the
        session holds it: a think-mode chat (past turns are re-rendered without their
        reasoning, from the generation prompt's <think> on), a reply cut by a stop string, an
        edited or regenerated reply. Returns how many prompt tokens were reused."""
        s, snap = self.session, self._snapshot
        if cached == len(prompt):  # the session holds exactly this prompt
            return cached
        if snap is not None and cached < len(snap.tokens) < len(prompt) \
                and prompt[:len(snap.tokens)] == snap.tokens:
            s.restore(snap)
            cached = len(snap.tokens)
        head = prompt[:-1]
        self._sync(head, job)  # (the session holds a prefix of head here, or nothing)
        if head and (snap is None or snap.tokens != head):
            self._snapshot = s.snapshot()
        s.eval(prompt[-1])
        return cached

    def _steps(self, s, n: int, req: GenRequest, rng: Rng) -> Iterator[tuple[int, dict | None]]:
        """(token, its logprob record or None), each evaluated by the session before it is
        yielded, end-of-sentence included (so that the session holds what the next turn's
        prompt will repeat)."""
        eos = self.tokenizer.eos_id
        if not self.split and req.logprobs is None:
            # Session.sample keeps a device that chooses tokens itself busy between steps
            for token in s.sample(n, req.params, rng, stop={eos}):
                yield token, None
            return
        for _ in range(n):
            if self.split:
                token, logprob = s.next_token(req.params, rng), None
            else:
                logits = s.logits
                token = sample(logits, req.params, rng)
                logprob = token_logprobs(logits, token, req.logprobs or 0)
            s.eval(token)
            yield token, logprob
            if token == eos:
                return


def finish_reason(reason: str | None, calls: bool) -> str:
    """Why a reply ended, as both APIs name it: reason None means the token limit. A reply whose
    tool calls ended the turn (end of sequence or a stop string) finished with them; one cut by
    the limit inside its calls block says "length", since calls after the cut may be missing."""
    if reason is None:
        return "length"
    if calls and reason == "stop":
        return "tool_calls"
    return reason


def same_text_prefix(tokenizer, held: list[int], prompt: list[int]) -> list[int]:
    """`prompt`, with its start written as the session's `held` tokens where both spell the same
    text (bytes and special tokens alike). A client resends the reply as text, and BPE of
    that text need not give back the tokens the model chose; this keeps the session reusable.
    """
    if not held or prompt[:len(held)] == held:
        return prompt
    special = set(tokenizer.special_ids.values())
    want = b"".join(tokenizer.token_bytes(t) for t in held)
    want_special = [t for t in held if t in special]
    got, k = 0, 0
    while k < len(prompt) and got < len(want):
        got += len(tokenizer.token_bytes(prompt[k]))
        k += 1
    if got != len(want):
        return prompt
    head = prompt[:k]
    if b"".join(tokenizer.token_bytes(t) for t in head) != want \
            or [t for t in head if t in special] != want_special:
        return prompt
    return held + prompt[k:]


def token_logprobs(logits: np.ndarray, token: int, top: int) -> dict:
    """The log-probability of `token` and of the `top` most likely tokens, under the model's
    own distribution (softmax of the logits, before temperature or truncation)."""
    x = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(x)
    mx = x[finite].max()
    lse = mx + math.log(np.exp(x[finite] - mx).sum())
    lp = x - lse
    best = []
    if top > 0:
        idx = np.argpartition(-lp, top - 1)[:top] if top < len(lp) else np.arange(len(lp))
        idx = idx[np.lexsort((idx, -lp[idx]))]
        best = [(int(i), float(lp[i])) for i in idx]
    return {"id": int(token), "logprob": float(lp[token]), "top": best}


async def next_event(job: Job, request, poll_s: float = DISCONNECT_POLL_S):
    """The job's next event; cancels the job (and returns None) once the client is gone. The
    client is looked for at each event (a token) and every `poll_s` while none comes (a prefill):
    looked for only when none came, a client that left while tokens came faster than that was
    never seen, and its generation ran to its end."""
    while True:
        try:
            ev = await asyncio.wait_for(job.events.get(), poll_s)
        except asyncio.TimeoutError:
            ev = None
        # (the server's own flag, set when it saw the connection close: no wait)
        if await request.is_disconnected():
            job.cancel()
            return None
        if ev is not None:
            return ev
