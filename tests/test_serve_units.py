"""The HTTP head's pieces without a server: DSML tool calls written by hand from spec §5, stop
strings across token boundaries, the reply channels, and response JSON parsed by the official
clients' own types."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from ds4.serve.anthropic_api import message
from ds4.serve.driver import Finished, same_text_prefix
from ds4.serve.openai_api import chat_completion
from ds4.serve.reply import CONTENT, REASONING, ReplyStream
from ds4.serve.stops import StopMatcher
from ds4.serve.tools import ToolCall, render_tool_calls, render_tool_result, split_tool_calls

# spec §5, "Server rendering": the DSML block of an assistant turn, byte for byte
SPEC_BLOCK = ("\n\n<｜DSML｜tool_calls>\n"
              '<｜DSML｜invoke name="get_weather">\n'
              '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
              "</｜DSML｜invoke>\n"
              '<｜DSML｜invoke name="search">\n'
              '<｜DSML｜parameter name="q" string="true">a "quoted" {x}</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="opts" string="false">{"n": [1, 2], "exact": true}</｜DSML｜parameter>\n'
              "</｜DSML｜invoke>\n"
              "</｜DSML｜tool_calls>")
SPEC_ARGS = [("get_weather", {"city": "Paris", "days": 3}),
             ("search", {"q": 'a "quoted" {x}', "opts": {"n": [1, 2], "exact": True}})]


@pytest.fixture(scope="module")
def tok():
    from ds4.core.default_model import default_model_path
    from ds4.core.gguf_model import GGUFModel
    from ds4.core.tokenizer import Tokenizer

    return Tokenizer.from_vocabulary(*GGUFModel(default_model_path()).vocabulary)


def test_render_tool_calls_is_the_spec_block():
    assert render_tool_calls([ToolCall(n, a) for n, a in SPEC_ARGS]) == SPEC_BLOCK


def test_split_tool_calls_parses_the_spec_block():
    answer, calls = split_tool_calls("Let me check." + SPEC_BLOCK)
    assert answer == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == SPEC_ARGS
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert split_tool_calls("no calls here") == ("no calls here", [])
    # cut off inside the second invoke: the complete first one is kept
    cut = SPEC_BLOCK[:SPEC_BLOCK.index('<｜DSML｜invoke name="search">') + 20]
    assert [(c.name, c.arguments) for c in split_tool_calls(cut)[1]] == SPEC_ARGS[:1]
    # a malformed JSON value is passed on as its text
    bad = SPEC_BLOCK.replace('string="false">3<', 'string="false">3,<')
    assert split_tool_calls(bad)[1][0].arguments["days"] == "3,"


def test_tool_result_escapes_only_its_closing_tag():
    assert render_tool_result("a</tool_result>b<tool_result>") == \
        "<tool_result>a&lt;/tool_result>b<tool_result></tool_result>"


@pytest.mark.parametrize("pieces, stops, want, hit", [
    (["Hel", "lo wo", "rld"], ["o w"], "Hell", "o w"),
    (["ab", "c", "d"], ["cd", "bc"], "a", "bc"),  # the earliest match wins
    (["x", "y"], ["yz"], "xy", None),  # a held prefix that never completes is emitted
    (["STO", "P!"], ["STOP"], "", "STOP"),
])
def test_stop_matcher_across_pieces(pieces, stops, want, hit):
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces) + m.flush()
    assert (out, m.hit) == (want, hit)


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["</end>"])
    assert m.push("text </e") == "text "
    assert m.push("x") == "</ex"


def test_reply_stream_channels_and_tool_calls(tok):
    """Tokens of a thinking reply that calls tools: reasoning, answer, then DSML (its markers as
    the special token, as the model emits them)."""
    ids = (tok.encode("Weighing options.") + [tok.think_end_id] + tok.encode("Checking.")
           + tok.encode_rendered(SPEC_BLOCK) + [tok.eos_id])
    r = ReplyStream(tok, think=True, tools=True)
    pieces = []
    for t in ids[:-1]:
        pieces += r.push(t)
    end, calls = r.finish()
    pieces += end
    assert "".join(t for ch, t in pieces if ch == REASONING) == "Weighing options."
    assert "".join(t for ch, t in pieces if ch == CONTENT) == "Checking."  # no blank line, no markup
    assert [(c.name, c.arguments) for c in calls] == SPEC_ARGS
    assert r.done  # the closing marker ends the generation


def test_reply_stream_without_tools_keeps_markup_as_text(tok):
    r = ReplyStream(tok, think=False, tools=False, stops=["zz"])
    text = "a\n\nb" + "<｜DSML｜tool_calls>"
    out = [p for t in tok.encode_rendered(text) for p in r.push(t)]
    out += r.finish()[0]
    assert "".join(t for _, t in out) == text and not r.done


def test_same_text_prefix(tok):
    held = tok.encode("Hello") + tok.encode(" world")
    prompt = tok.encode("Hello world") + [tok.eos_id, tok.user_id] + tok.encode("next")
    assert same_text_prefix(tok, held, prompt) == held + prompt[len(tok.encode("Hello world")):]
    # a typed special-token string is not the special token
    typed = tok.encode("<｜User｜>x")
    assert same_text_prefix(tok, [tok.user_id] + tok.encode("x"), typed + [1]) == typed + [1]
    assert same_text_prefix(tok, held, tok.encode("Help")) == tok.encode("Help")


def _finished(text, reasoning="", calls=(), reason="tool_calls"):
    return Finished(reason, None, 12, 5, 7, list(calls), [], {CONTENT: text, REASONING: reasoning})


def test_openai_tool_calls_parse_as_the_clients_types():
    _, calls = split_tool_calls(SPEC_BLOCK)
    body = chat_completion(_finished("", "thought", calls), model="ds4", logprobs=None)
    c = openai.types.chat.ChatCompletion.model_validate(json.loads(json.dumps(body)))
    msg = c.choices[0].message
    assert c.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == SPEC_ARGS
    assert all(t.type == "function" and t.id for t in msg.tool_calls)
    assert msg.model_extra["reasoning_content"] == "thought"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (12, 7, 19)
    assert c.usage.prompt_tokens_details.cached_tokens == 5


def test_anthropic_tool_use_parses_as_the_clients_types():
    _, calls = split_tool_calls("Sure." + SPEC_BLOCK)
    body = message(_finished("Sure.", "thought", calls), model="ds4")
    m = anthropic.types.Message.model_validate(json.loads(json.dumps(body)))
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert m.content[0].thinking == "thought" and m.content[1].text == "Sure."
    assert [(b.name, b.input) for b in m.content[2:]] == SPEC_ARGS
    assert all(b.id.startswith("toolu_") for b in m.content[2:])
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (7, 5, 7)
    stop = message(Finished("stop", "END", 3, 0, 1, [], [], {CONTENT: "x", REASONING: ""}), model="ds4")
    m = anthropic.types.Message.model_validate(stop)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")


def _reply_events(tok, text_ids, *, think):
    """The driver's events for a reply of these token ids (run through the real ReplyStream)."""
    from ds4.serve.driver import Token

    r = ReplyStream(tok, think=think, tools=True)
    evs = []
    for t in text_ids:
        channel = r.channel
        pieces = r.push(t)
        evs.append(Token(pieces, None, "tool" if r.tool_text is not None else channel))
    pieces, calls = r.finish()
    evs.append(Finished("tool_calls" if calls else "stop", r.stop_hit, 9, 4, len(text_ids), calls,
                        pieces, dict(r.text)))
    return evs


async def _aiter(items):
    for x in items:
        yield x


def _collect(agen) -> list[str]:
    import asyncio

    async def run():
        return [x async for x in agen]

    return asyncio.run(run())


def test_openai_stream_of_a_tool_call_accumulates_in_the_client(tok):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from ds4.serve.openai_api import chat_chunks

    ids = [tok.think_end_id] + tok.encode("Sure.") + tok.encode_rendered(SPEC_BLOCK)
    lines = _collect(chat_chunks(_aiter(_reply_events(tok, ids, think=True)), tok=tok, cid="c1",
                                 created=1, model="ds4", logprobs=False, include_usage=True))
    assert lines[-1] == "data: [DONE]\n\n"
    state = ChatCompletionStreamState()
    for line in lines[:-1]:
        assert line.startswith("data: ") and line.endswith("\n\n")
        chunk = ChatCompletionChunk.model_validate(json.loads(line[6:]))
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and msg.content == "Sure."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == SPEC_ARGS
    assert final.usage.prompt_tokens == 9 and final.usage.prompt_tokens_details.cached_tokens == 4


def test_anthropic_stream_event_sequence_accumulates_in_the_client(tok):
    from pydantic import TypeAdapter

    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent

    from ds4.serve.anthropic_api import message_events
    from ds4.serve.driver import Started

    ids = tok.encode("Hmm.") + [tok.think_end_id] + tok.encode("Sure.") + tok.encode_rendered(SPEC_BLOCK)
    raw = _collect(message_events(_aiter(_reply_events(tok, ids, think=True)), Started(9, 4),
                                  model="ds4", mid="msg_1"))
    adapter = TypeAdapter(RawMessageStreamEvent)
    names, snapshot, bufs = [], None, {}
    for text in raw:
        head, data = text.rstrip("\n").split("\n")
        name = head.removeprefix("event: ")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert event.type == name
        names.append(name)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 4
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert snapshot.content[0].thinking == "Hmm." and snapshot.content[1].text == "Sure."
    assert [(b.name, b.input) for b in snapshot.content[2:]] == SPEC_ARGS
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == len(ids)
    assert snapshot.usage.cache_read_input_tokens == 4


def test_exposure_warning_and_api_key(tmp_path, monkeypatch):
    from cli.common import CLIError
    from cli.serve import exposure_warning, read_api_key

    for host in ("127.0.0.1", "::1", "localhost", "127.5.0.1"):
        assert exposure_warning(host, None) is None
    for host in ("0.0.0.0", "::", "192.168.1.4", "example.org"):
        assert "without an API key" in exposure_warning(host, None)
        assert exposure_warning(host, "k") is None
    monkeypatch.delenv("DS4_API_KEY", raising=False)
    assert read_api_key(None) is None
    monkeypatch.setenv("DS4_API_KEY", " from-env \n")
    assert read_api_key(None) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\nignored\n")
    assert read_api_key(f) == "from-file"  # the file wins over the environment
    f.write_text("\n")
    with pytest.raises(CLIError, match="empty"):
        read_api_key(f)
    with pytest.raises(CLIError, match="api-key-file"):
        read_api_key(tmp_path / "missing")


@pytest.mark.parametrize("ctx", [4096, 393216])
def test_think_max_needs_its_context(tok, ctx):
    """Think-Max's prefix goes into the prompt only where the context holds THINK_MAX_MIN_CONTEXT
    tokens (as ds4 does); the prefix's text is the spec's, from core/chat.py."""
    from types import SimpleNamespace

    from ds4.core.chat import THINK_MAX_MIN_CONTEXT, THINK_MAX_PREFIX
    from ds4.serve.prompt import Conversation, Turn
    from ds4.serve.shared import encode_conversation

    state = SimpleNamespace(tokenizer=tok, ctx=ctx)
    conv = Conversation(turns=[Turn("user", "hi")])
    ids = encode_conversation(state, conv, think=True, think_max=True)
    plain = encode_conversation(state, conv, think=True, think_max=False)
    prefix = tok.encode(THINK_MAX_PREFIX)
    has = any(ids[i:i + len(prefix)] == prefix for i in range(len(ids)))
    assert has == (ctx >= THINK_MAX_MIN_CONTEXT)
    assert (ids == plain) == (ctx < THINK_MAX_MIN_CONTEXT)


def test_driver_session_prefills_in_chunks_of_prefill_cap():
    """`ds4 serve --prefill-cap` reaches the served session's layout (None keeps the default)."""
    import ds4
    from ds4.core.state import DEFAULT_PREFILL_CAP
    from ds4.serve.driver import Driver

    eng = ds4.Engine.open(None, backend="reference")
    for cap, want in ((8, 8), (None, min(DEFAULT_PREFILL_CAP, 64))):
        d = Driver(eng, ctx=64, queue_size=1, prefill_cap=cap)
        try:
            assert d.session.layout.prefill_cap == want
        finally:
            d.close()


@pytest.mark.parametrize("why", ["shutdown", "client left"])
def test_driver_stops_a_long_prefill_between_chunks(why):
    """A request still prefilling its prompt when the server stops (or its client leaves) ends
    before the next prefill chunk, not after the whole prompt: the 503 says how far it got, and
    the session holds the chunks done so far."""
    import asyncio

    import ds4
    from ds4.core.sampling import GREEDY
    from ds4.serve.driver import SHUTTING_DOWN, Driver, Failed, GenRequest, Job

    cap, prompt = 8, [3 + i % 50 for i in range(40)]
    eng = ds4.Engine.open(None, backend="reference")
    d = Driver(eng, ctx=64, queue_size=1, prefill_cap=cap, stop_check_tokens=cap)
    loop = asyncio.new_event_loop()
    try:
        job = Job(GenRequest(prompt=prompt, max_tokens=4, params=GREEDY, seed=0), loop)
        seen, sync = [], d.session.sync

        def sync_then_stop(tokens):
            seen.append(len(tokens))
            sync(tokens)
            d.stop_all() if why == "shutdown" else job.cancel()

        d.session.sync = sync_then_stop
        d._run(job)
        loop.run_until_complete(asyncio.sleep(0))
        events = [job.events.get_nowait() for _ in range(job.events.qsize())]
        assert seen == [cap]
        assert d.session.tokens == prompt[:cap]
        if why == "shutdown":
            assert events == [Failed(503, f"{SHUTTING_DOWN}; the prompt stopped after {cap} of its "
                                          f"{len(prompt)} tokens")]
        else:
            assert events == []
            assert d.metrics.registry.get_sample_value("ds4_cancelled_generations_total") == 1
    finally:
        d.close()
        loop.close()


# ---- the app over a stand-in driver (no engine: what is checked happens before a generation)

APP_CTX = 64


class _LoopWatchingTokenizer:
    """The real tokenizer, noting for each encode whether it ran on a thread running an event loop."""

    def __init__(self, tok):
        self._tok = tok
        self.on_loop: list[bool] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def _note(self) -> None:
        import asyncio

        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)

    def encode(self, text):
        self._note()
        return self._tok.encode(text)

    def encode_rendered(self, text):
        self._note()
        return self._tok.encode_rendered(text)


def _app_client(tok, submit, ctx: int = APP_CTX):
    """(an in-process client of create_app's app, its stand-in driver) whose `submit` is given."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from ds4.serve.app import create_app
    from ds4.serve.metrics import Metrics

    driver = SimpleNamespace(tokenizer=tok, ctx=ctx, metrics=Metrics(), remote=False, submit=submit)
    app = create_app(driver, model_id="ds4", max_tokens_limit=ctx)
    return TestClient(app, raise_server_exceptions=False), driver


def test_an_unhandled_error_is_counted_as_500(tok):
    def submit(req):
        raise RuntimeError("the engine broke")

    client, driver = _app_client(tok, submit)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 1})
    assert r.status_code == 500
    count = driver.metrics.registry.get_sample_value
    assert count("ds4_requests_total", {"endpoint": "/v1/chat/completions", "status": "500"}) == 1
    assert count("ds4_requests_total", {"endpoint": "/v1/chat/completions", "status": "0"}) is None


def test_a_prompt_is_tokenized_off_the_event_loop_after_its_length_is_checked(tok):
    """The prompt's text is tokenized on a worker thread, not the event loop's; text longer than
    the context can hold at the tokenizer's longest token per token is refused before any of it
    is tokenized, and text within that bound is not refused by it."""
    from ds4.serve.driver import QueueFull

    watched = _LoopWatchingTokenizer(tok)
    submitted = []

    def submit(req):
        submitted.append(req)
        raise QueueFull(1)

    client, _ = _app_client(watched, submit)
    longest = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
    most = APP_CTX * longest  # characters (each one byte or more) that may be the context's tokens

    def requests(text):
        msgs = [{"role": "user", "content": text}]
        return [("/v1/chat/completions", {"messages": msgs, "max_tokens": 1}, "messages"),
                ("/v1/messages", {"messages": msgs, "max_tokens": 1}, "messages"),
                ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt")]

    for path, body, param in requests("x" * (most + 1)):
        r = client.post(path, json=body)
        message = r.json()["error"]["message"]
        assert r.status_code == 400, message
        assert f"the prompt's text has {most + 1} characters" in message, message
        assert f"at least {APP_CTX + 1} tokens" in message, message
    assert watched.on_loop == []  # refused untokenized
    for path, body, param in requests("x" * most):  # within the bound: tokenized, then too long
        r = client.post(path, json=body)
        message = r.json()["error"]["message"]
        assert r.status_code == 400, message
        assert re.search(r"(the prompt has|prompt is too long:) \d+ tokens", message), message
    for path, body, param in requests("hi"):
        assert client.post(path, json=body).status_code == 429
    assert len(submitted) == 3
    assert watched.on_loop and not any(watched.on_loop)


def test_a_waiting_job_whose_client_left_frees_its_queue_slot():
    """With one generation running and the queue (of 1) full, a waiting client that leaves gives
    its slot back at once: the next request is queued, not refused with 429."""
    import asyncio
    import threading

    import ds4
    from ds4.core.sampling import GREEDY
    from ds4.serve.driver import Driver, GenRequest, QueueFull

    d = Driver(ds4.Engine.open(None, backend="reference"), ctx=64, queue_size=1)
    running, release = threading.Event(), threading.Event()

    def held_run(job):  # (the running generation, held until the test lets it go)
        running.set()
        release.wait(30)

    d._run = held_run

    async def scenario():
        req = GenRequest(prompt=[5, 6], max_tokens=1, params=GREEDY, seed=0)
        d.submit(req)
        assert await asyncio.to_thread(running.wait, 30)
        waiting = d.submit(req)
        with pytest.raises(QueueFull):
            d.submit(req)
        waiting.cancel()
        taken = d.submit(req)  # (the freed slot)
        with pytest.raises(QueueFull):
            d.submit(req)
        taken.cancel()
        for _ in range(100):  # clients that come and go keep nothing waiting
            d.submit(req).cancel()
        assert len(d._waiting) == 0

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        d.close()


def test_finish_reason_of_tool_calls_cut_by_the_limit():
    """Tool calls end the turn only when the reply ended (end of sequence or a stop string); a
    reply the token limit cut inside its calls block says "length"."""
    from ds4.serve.driver import finish_reason

    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason(None, True) == "length"
    assert finish_reason(None, False) == "length"
    assert finish_reason("stop", False) == "stop"
    assert finish_reason("cancelled", True) == "cancelled"


# ---- the official clients against the app over a stand-in driver ---------------------------------

def _official_clients(tok, submit, ctx: int = APP_CTX):
    """(openai client, anthropic client, stand-in driver) talking to create_app's app in process
    (the test client is an httpx client, which both official clients take)."""
    client, driver = _app_client(tok, submit, ctx)
    oa = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="-", http_client=client, max_retries=0)
    an = anthropic.Anthropic(base_url=str(client.base_url), api_key="-", http_client=client, max_retries=0)
    return oa, an, driver


def _queue_full(submitted: list):
    """A stand-in submit that keeps the request (it passed every check) and answers 429."""
    from ds4.serve.driver import QueueFull

    def submit(req):
        submitted.append(req)
        raise QueueFull(1)

    return submit


OPENAI_MAX_STOP = 4  # OpenAI's API reference: `stop`, "up to 4 sequences"
# The server's own bound on Anthropic's stop_sequences (ds4/serve/anthropic_api.py), written out
# here so that changing it there fails this test instead of moving with it.
MAX_STOP_SEQUENCES = 16


def test_openai_takes_at_most_four_stop_strings(tok):
    """OpenAI's `stop` takes up to 4 strings: 4 go to the generation, 5 are a 400 naming `stop`,
    the limit and the count (they were taken, up to 16)."""
    submitted = []
    oa, _, _ = _official_clients(tok, _queue_full(submitted))
    msgs = [{"role": "user", "content": "hi"}]
    stops = [f"s{i}" for i in range(OPENAI_MAX_STOP + 1)]
    calls = (lambda stop: oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=1, stop=stop),
             lambda stop: oa.completions.create(model="ds4", prompt="hi", max_tokens=1, stop=stop))
    for call in calls:
        with pytest.raises(openai.RateLimitError):  # (every check passed: the stand-in's 429)
            call(stops[:OPENAI_MAX_STOP])
        assert submitted.pop().stops == stops[:OPENAI_MAX_STOP]
        with pytest.raises(openai.BadRequestError) as e:
            call(stops)
        assert e.value.status_code == 400 and e.value.body["param"] == "stop"
        assert e.value.body["message"] == (f"stop: expected at most {OPENAI_MAX_STOP} stop sequences "
                                           f"(OpenAI's limit), got {OPENAI_MAX_STOP + 1}")
        assert submitted == []


def test_anthropic_stop_sequences_keep_the_servers_own_limit(tok):
    """Anthropic documents no limit on stop_sequences: more than OpenAI's 4 are taken, up to the
    server's own bound, and one more is a 400 naming the field, the limit and the count."""
    submitted = []
    _, an, _ = _official_clients(tok, _queue_full(submitted))
    msgs = [{"role": "user", "content": "hi"}]
    stops = [f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1)]
    with pytest.raises(anthropic.RateLimitError):
        an.messages.create(model="ds4", max_tokens=1, messages=msgs, stop_sequences=stops[:-1])
    assert submitted.pop().stops == stops[:-1]
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=1, messages=msgs, stop_sequences=stops)
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": f"stop_sequences: expected at most {MAX_STOP_SEQUENCES} stop sequences (this "
                   f"server's limit), got {MAX_STOP_SEQUENCES + 1}"}}
    assert submitted == []


def test_max_tokens_past_the_context_is_refused_naming_the_context(tok):
    """A request whose prompt and max_tokens pass the server's context gets a 400 naming the
    field, the context, the prompt's tokens and the value (as OpenAI and Anthropic answer it);
    it was cut to what the context left, in silence. One that fits exactly is taken whole, and
    one that asks for no limit gets what the context leaves. The prompts' sizes are counted
    here from the chat template of spec §5, by hand."""
    submitted = []
    oa, an, _ = _official_clients(tok, _queue_full(submitted))
    msgs = [{"role": "user", "content": "hi"}]
    # BOS <｜User｜>hi <｜Assistant｜> and <think> (OpenAI's default) or </think> (Anthropic's)
    chat = len([tok.bos_id, tok.user_id] + tok.encode("hi") + [tok.assistant_id, tok.think_start_id])

    def message(param, prompt, asked):
        return (f"This model's maximum context length is {APP_CTX} tokens; you requested {prompt + asked} "
                f"tokens ({prompt} in the prompt, {asked} for {param}): {param} may be at most "
                f"{APP_CTX - prompt}")

    openai_calls = [  # (the call with a limit, its field, the prompt's tokens)
        (lambda n: oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=n),
         "max_tokens", chat),
        (lambda n: oa.chat.completions.create(model="ds4", messages=msgs, max_completion_tokens=n),
         "max_completion_tokens", chat),
        (lambda n: oa.completions.create(model="ds4", prompt="hi", max_tokens=n),
         "max_tokens", len(tok.encode("hi")))]
    for call, param, prompt in openai_calls:
        room = APP_CTX - prompt
        with pytest.raises(openai.RateLimitError):  # (every check passed: the stand-in's 429)
            call(room)
        req = submitted.pop()
        assert (len(req.prompt), req.max_tokens) == (prompt, room)
        with pytest.raises(openai.BadRequestError) as e:
            call(room + 1)
        assert e.value.status_code == 400 and e.value.body["param"] == param
        assert e.value.body["message"] == message(param, prompt, room + 1)
        assert submitted == []

    room = APP_CTX - chat
    with pytest.raises(anthropic.RateLimitError):
        an.messages.create(model="ds4", max_tokens=room, messages=msgs)
    assert submitted.pop().max_tokens == room
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=room + 1, messages=msgs)
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": f"input length and `max_tokens` exceed context limit: {chat} + {room + 1} > {APP_CTX}"}}
    assert submitted == []

    with pytest.raises(openai.RateLimitError):  # no limit asked for: what the context leaves
        oa.chat.completions.create(model="ds4", messages=msgs)
    assert submitted.pop().max_tokens == APP_CTX - chat


def _raw(client, path: str, body: str):
    """POST a JSON body written by hand (the official clients cannot send a lone surrogate: they
    encode their JSON as UTF-8 text, where JSON itself may carry one escaped, "\\ud800")."""
    return client.post(path, content=body.encode("ascii"), headers={"Content-Type": "application/json"})


LONE = "a\\ud800b"  # JSON text: "a", a lone surrogate, "b"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}',
     "messages[0].content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "system", "content": "ok"}}, {{"role": "user", '
                             f'"content": [{{"type": "text", "text": "{LONE}"}}]}}]}}',
     "messages[1].content[0].text"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}], "tools": [{{"type": '
                             f'"function", "function": {{"name": "f", "description": "{LONE}"}}}}]}}',
     "tools[0].function.description"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", '
                             f'"tool_calls": [{{"id": "c", "type": "function", "function": {{"name": "f", '
                             f'"arguments": "{{\\"q\\": \\"{LONE}\\"}}"}}}}]}}]}}',
     "messages[1].tool_calls[0].function.arguments@8"),  # (its character 8: '{"q": "a' before it)
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}], "model": "{LONE}"}}',
     "model"),
    ("/v1/completions", f'{{"prompt": "{LONE}"}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["{LONE}"]}}', "prompt[0]"),
    ("/v1/messages", f'{{"max_tokens": 1, "messages": [{{"role": "user", "content": "{LONE}"}}]}}',
     "messages[0].content"),
    ("/v1/messages", f'{{"max_tokens": 1, "system": "{LONE}", "messages": [{{"role": "user", '
                     f'"content": "hi"}}]}}',
     "system"),
    ("/v1/messages", f'{{"max_tokens": 1, "messages": [{{"role": "user", "content": [{{"type": "tool_result", '
                     f'"tool_use_id": "t", "content": "{LONE}"}}]}}]}}',
     "messages[0].content[0].content"),
    ("/v1/messages", f'{{"max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}, {{"role": '
                     f'"assistant", "content": [{{"type": "tool_use", "id": "t", "name": "f", "input": '
                     f'{{"q": "{LONE}"}}}}]}}]}}',
     "messages[1].content[0].input.q"),
    ("/v1/messages", f'{{"max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}], "tools": '
                     f'[{{"name": "f", "input_schema": {{"type": "object", "properties": '
                     f'{{"{LONE}": {{}}}}}}}}]}}',
     "tools[0].input_schema.properties"),
    ("/v1/messages/count_tokens", f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}',
     "messages[0].content"),
])
def test_a_lone_surrogate_in_request_text_is_a_400_naming_its_field(tok, path, body, param):
    """JSON may escape a lone surrogate ("\\ud800"), which is no character UTF-8 can encode: the
    request gets a 400 in its API's error JSON naming the field (a key, the object holding it),
    not a plain-text 500 from the tokenizer; nothing reaches the generation."""
    submitted = []
    client, _ = _app_client(tok, _queue_full(submitted))
    r = _raw(client, path, body)
    assert r.status_code == 400, r.text
    param, _, at = param.partition("@")
    where = f"{param}: a key" if param.endswith("properties") else param
    message = f"{where}: expected UTF-8 text, got a lone surrogate U+D800 at character {at or 1}"
    if path.startswith("/v1/messages"):
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    else:
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                      "param": param, "code": None}}
    assert submitted == []


def test_a_prompt_past_the_context_gets_the_code_and_wording_clients_key_on(tok):
    """A prompt the context cannot hold, or a prompt and max_tokens that pass it, gets each
    API's own wording, which clients look for to shorten a history: OpenAI's code
    "context_length_exceeded" and "maximum context length is N tokens" (and the field in
    param), Anthropic's "prompt is too long: P tokens > N maximum" and "input length and
    `max_tokens` exceed context limit: P + M > N". Counted by hand from spec §5's template."""
    submitted = []
    oa, an, _ = _official_clients(tok, _queue_full(submitted))

    def chat_tokens(text):  # BOS <｜User｜>text <｜Assistant｜> <think> or </think>
        return 4 + len(tok.encode(text))

    long = " hi" * APP_CTX
    msgs = [{"role": "user", "content": long}]
    n = chat_tokens(long)
    assert n > APP_CTX
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="ds4", messages=msgs)
    assert (e.value.code, e.value.param, e.value.type) == ("context_length_exceeded", "messages",
                                                           "invalid_request_error")
    assert e.value.body["message"] == (f"This model's maximum context length is {APP_CTX} tokens; the "
                                       f"prompt has {n} tokens, which leaves no room for a reply: "
                                       f"shorten messages")
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="ds4", prompt=long)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "prompt")
    assert f"maximum context length is {APP_CTX} tokens" in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=1, messages=msgs)
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > {APP_CTX} maximum"}}

    short = [{"role": "user", "content": "hi"}]
    n = chat_tokens("hi")
    asked = APP_CTX - n + 1
    for param in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="ds4", messages=short, **{param: asked})
        assert (e.value.code, e.value.param) == ("context_length_exceeded", param)
        assert e.value.body["message"] == (
            f"This model's maximum context length is {APP_CTX} tokens; you requested {n + asked} "
            f"tokens ({n} in the prompt, {asked} for {param}): {param} may be at most {APP_CTX - n}")
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=asked, messages=short)
    assert e.value.body["error"] == {
        "type": "invalid_request_error",
        "message": f"input length and `max_tokens` exceed context limit: {n} + {asked} > {APP_CTX}"}
    # a prompt that fills the context exactly is not too long for Anthropic: max_tokens is
    full = next(t for t in (" hi" * k for k in range(APP_CTX)) if chat_tokens(t) == APP_CTX)
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=1, messages=[{"role": "user", "content": full}])
    assert e.value.body["error"]["message"] == (f"input length and `max_tokens` exceed context limit: "
                                                f"{APP_CTX} + 1 > {APP_CTX}")
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="ds4", messages=[{"role": "user", "content": full}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"

    # text longer than the context can hold, refused before it is tokenized: a lower bound
    longest = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
    chars = APP_CTX * longest + 1
    least = -(-chars // longest)
    huge = [{"role": "user", "content": "x" * chars}]
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="ds4", messages=huge)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "messages")
    assert e.value.body["message"].startswith(f"This model's maximum context length is {APP_CTX} "
                                              f"tokens; the prompt's text has {chars} characters, at "
                                              f"least {least} tokens")
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=1, messages=huge)
    assert e.value.body["error"]["message"].startswith(f"prompt is too long: at least {least} tokens > "
                                                       f"{APP_CTX} maximum (")
    assert submitted == []


def _replying(tok, text: str, reason: str | None, think: bool):
    """A stand-in submit whose job replies with `text`'s tokens (through the real ReplyStream)
    and ends as the driver ends it: `reason` None is the token limit."""
    import asyncio

    from ds4.serve.driver import Job, Started, Token, finish_reason

    def submit(req):
        job = Job(req, asyncio.get_running_loop())
        r = ReplyStream(tok, think=think)
        ids = tok.encode(text)
        job.events.put_nowait(Started(len(req.prompt), 0))
        for t in ids:
            channel = r.channel
            job.events.put_nowait(Token(r.push(t), None, channel))
        pieces, calls = r.finish()
        job.events.put_nowait(Finished(finish_reason(reason, bool(calls)), r.stop_hit, len(req.prompt), 0,
                                       len(ids), calls, pieces, dict(r.text)))
        return job

    return submit


def test_anthropic_reply_cut_while_thinking_is_the_same_streamed_and_has_no_empty_text(tok):
    """A thinking reply that max_tokens cuts before its answer is one thinking block, streamed
    or not (it had an empty text block after it when not streamed, which the real API refuses
    in a request: a client sending the reply back got a 400); an empty reply is one empty text
    block both ways, as before."""
    _, an, _ = _official_clients(tok, _replying(tok, "Let me weigh this", None, think=True))
    kw = dict(model="ds4", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
              thinking={"type": "enabled", "budget_tokens": 1024})
    whole = an.messages.create(**kw)
    with an.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for m in (whole, streamed):
        assert m.stop_reason == "max_tokens"
        assert [b.model_dump() for b in m.content] == [
            {"type": "thinking", "thinking": "Let me weigh this", "signature": ""}]

    _, an, _ = _official_clients(tok, _replying(tok, "", "stop", think=False))
    kw = dict(model="ds4", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    whole = an.messages.create(**kw)
    with an.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for m in (whole, streamed):
        assert [b.model_dump() for b in m.content] == [{"type": "text", "text": "", "citations": None}]


def test_anthropic_disable_parallel_tool_use_is_refused(tok):
    """This server cannot hold a reply to one tool call: tool_choice's disable_parallel_tool_use
    true is a 400 naming it (as OpenAI's parallel_tool_calls false is), false or absent is taken."""
    submitted = []
    _, an, _ = _official_clients(tok, _queue_full(submitted), ctx=1024)  # (room for the tool prompt)
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
    msgs = [{"role": "user", "content": "hi"}]
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"}):
        for value in (True, False, None):
            tc = choice if value is None else {**choice, "disable_parallel_tool_use": value}
            if value:
                with pytest.raises(anthropic.BadRequestError) as e:
                    an.messages.create(model="ds4", max_tokens=1, messages=msgs, tools=tools, tool_choice=tc)
                assert e.value.body["error"]["message"] == (
                    "tool_choice.disable_parallel_tool_use: this server cannot hold a reply to one tool "
                    "call: expected false, got true")
                assert submitted == []
            else:
                with pytest.raises(anthropic.RateLimitError):  # (every check passed)
                    an.messages.create(model="ds4", max_tokens=1, messages=msgs, tools=tools, tool_choice=tc)
                assert submitted.pop().tools
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=1, messages=msgs, tools=tools,
                           tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"})
    assert e.value.body["error"]["message"].startswith("tool_choice.disable_parallel_tool_use: ")
