"""`ds4 serve` on the embedded default model, driven by the official openai and anthropic clients.

One server process (reference backend, an API key, a queue of one) serves every test here. The
expected texts come from paths independent of the HTTP head: `ds4 generate -t 0` in its own
process, and the library's Session driven greedily in this process.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest

from ds4.core.chat import DEFAULT_SYSTEM

from serve_helpers import ROOT, Proc, metric, wait_idle

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
# (this anthropic client has no sampling arguments; the server still reads them from the body)
T0 = {"temperature": 0}
N = 3  # tokens per reply: the text is gibberish (random weights), a few tokens say enough
MAX_BODY = 256 << 10  # the server's --max-body: small, so that a body over it is quick to send


def _generate_argv(prompt: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", "generate", "-p", prompt, "-n", str(N), "-t", "0",
            "--nothink", "--backend", "reference"]


@pytest.fixture(scope="module")
def generate_hi():
    """`ds4 generate -t 0 --nothink -p hi`, started early so that it runs while the server loads."""
    p = subprocess.Popen(_generate_argv("hi"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    yield p
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory, generate_hi):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = Proc(["serve", "--port", "0", "--backend", "reference", "--queue", "1", "--ctx", "1024",
                 "--max-tokens-limit", "512", "--max-body", str(MAX_BODY)], log, env={"DS4_API_KEY": KEY})
    try:
        yield proc.wait_listening().wait_healthy()
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine():
    import ds4

    return ds4.Engine.open(None, backend="reference")


_greedy: dict = {}


def greedy_ids(engine, ids: list[int], n: int) -> list[int]:
    """The library's own greedy continuation (cold session), the reference for the server."""
    key = (tuple(ids), n)
    if key not in _greedy:
        s = engine.session(ctx=1024)
        s.sync(ids)
        _greedy[key] = list(s.greedy(n, stop={engine.tokenizer.eos_id}))
    return _greedy[key]


def chat_ids(tok, user: str, think: bool, system: str | None = None) -> list[int]:
    """BOS [system] <｜User｜>user <｜Assistant｜><think> | </think>, by hand (spec §5)."""
    ids = [tok.bos_id] + (tok.encode(system) if system else []) + [tok.user_id] + tok.encode(user)
    return ids + [tok.assistant_id, tok.think_start_id if think else tok.think_end_id]


def test_models_health_metrics(server, oa):
    assert [m.id for m in oa.models.list().data] == ["ds4-default"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"  # open without a key
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    for name in ("ds4_requests_total", "ds4_queue_depth", "ds4_prompt_tokens_total",
                 "ds4_generated_tokens_total", "ds4_prefill_tokens_per_second",
                 "ds4_decode_tokens_per_second"):
        assert name in text
    # a path the server does not serve is counted, under one label: clients cannot add series
    for junk in ("/v1/nonexistent", "/v1/x1", "/v1/x2"):
        assert httpx.get(f"{server.url}{junk}", headers=AUTH).status_code == 404
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert "nonexistent" not in text and "/v1/x1" not in text
    assert metric(server.url, 'ds4_requests_total{endpoint="other",status="404"}', AUTH) >= 3
    assert metric(server.url, 'ds4_requests_total{endpoint="/v1/models",status="200"}', AUTH) >= 1


def test_stream_equals_nonstream_and_usage(oa, engine):
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "Hello"}]
    r = oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=N, temperature=0)
    reasoning = r.choices[0].message.model_extra["reasoning_content"]
    parts = {"reasoning_content": "", "content": ""}
    usage = finish = None
    for c in oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=N, temperature=0,
                                        stream=True, stream_options={"include_usage": True}):
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            finish = ch.finish_reason or finish
            for key in parts:
                parts[key] += getattr(ch.delta, key, None) or (ch.delta.model_extra or {}).get(key) or ""
    assert (parts["reasoning_content"], parts["content"]) == (reasoning, r.choices[0].message.content)
    # think mode (the default): the reply is reasoning until </think>; the greedy ids in-process
    ids = chat_ids(tok, "Hello", think=True)
    want = greedy_ids(engine, ids, N)
    assert tok.eos_id not in want and tok.think_end_id not in want
    assert reasoning == tok.decode(want)
    assert r.choices[0].finish_reason == finish == "length"
    assert r.usage.prompt_tokens == usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == usage.completion_tokens == N


def test_temperature0_equals_ds4_generate(oa, generate_hi):
    stdout, stderr = generate_hi.communicate(timeout=300)
    assert generate_hi.returncode == 0, stderr
    r = oa.chat.completions.create(
        model="ds4", messages=[{"role": "system", "content": DEFAULT_SYSTEM},
                               {"role": "user", "content": "hi"}],
        max_tokens=N, temperature=0, reasoning_effort="none")
    assert r.choices[0].message.content == stdout.removesuffix("\n")
    assert r.choices[0].message.model_extra.get("reasoning_content") is None


def test_anthropic_stream_nonstream_usage(an, oa, engine):
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "Hello"}]
    m = an.messages.create(model="ds4", max_tokens=N, messages=msgs, extra_body=T0)
    with an.messages.stream(model="ds4", max_tokens=N, messages=msgs, extra_body=T0) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert isinstance(m, anthropic.types.Message)
    assert m.content[0].type == "text" and streamed == m.content[0].text == final.content[0].text
    assert m.stop_reason == final.stop_reason == "max_tokens"
    ids = chat_ids(tok, "Hello", think=False)
    assert m.content[0].text == tok.decode(greedy_ids(engine, ids, N))
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ids)
    assert m.usage.output_tokens == N
    assert an.messages.count_tokens(model="ds4", messages=msgs).input_tokens == len(ids)


def test_top_p_zero_keeps_the_most_probable_token(oa, an, engine):
    """top_p 0 at temperature 1 is the greedy reply in both APIs (the nucleus of mass 0 is the
    top token; it was refused, and ds4's sampler reads it as off)."""
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "Hello"}]
    want = tok.decode(greedy_ids(engine, chat_ids(tok, "Hello", think=False), N))
    for seed in (1, 2):
        r = oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=N, temperature=1, top_p=0,
                                       seed=seed, reasoning_effort="none")
        assert r.choices[0].message.content == want
        m = an.messages.create(model="ds4", max_tokens=N, messages=msgs,
                               extra_body={"temperature": 1, "top_p": 0, "seed": seed})
        assert m.content[0].text == want


def test_anthropic_thinking_block(an, engine):
    tok = engine.tokenizer
    m = an.messages.create(model="ds4", max_tokens=N, extra_body=T0,
                           thinking={"type": "enabled", "budget_tokens": 1024},
                           messages=[{"role": "user", "content": "Hello"}])
    assert m.content[0].type == "thinking"
    assert m.content[0].thinking == tok.decode(greedy_ids(engine, chat_ids(tok, "Hello", True), N))


def test_stop_sequences_across_tokens(oa, an):
    msgs = [{"role": "user", "content": "Tell me"}]
    chunks = [c.choices[0].delta.content for c in oa.chat.completions.create(
        model="ds4", messages=msgs, max_tokens=4, temperature=0, reasoning_effort="none", stream=True)
        if c.choices and c.choices[0].delta.content]
    full = "".join(chunks)
    i = next(k for k in range(1, len(chunks)) if chunks[k - 1] and chunks[k])
    stop = chunks[i - 1][-1] + chunks[i][0]  # spans the boundary between two tokens' text
    want = full[:full.find(stop)]
    r = oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=4, temperature=0,
                                   reasoning_effort="none", stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == want
    streamed = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
        model="ds4", messages=msgs, max_tokens=4, temperature=0, reasoning_effort="none",
        stop=stop, stream=True) if c.choices)
    assert streamed == want
    m = an.messages.create(model="ds4", max_tokens=4, messages=msgs, extra_body=T0, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", stop, want)


def test_logprobs_line_up_with_a_reply_cut_by_a_stop_sequence(oa):
    """The entries of a reply cut by a stop string are those of the tokens whose text it
    returns: the tokens that completed the dropped stop string have none, streamed or not."""
    kw = dict(model="ds4", messages=[{"role": "user", "content": "Tell me"}], max_tokens=4, temperature=0,
              reasoning_effort="none", logprobs=True)
    full = oa.chat.completions.create(**kw)
    toks = [bytes(e.bytes) for e in full.choices[0].logprobs.content]
    text = [t.decode("utf-8") for t in toks]
    assert "".join(text) == full.choices[0].message.content and len(toks) == 4
    i = next(k for k in range(1, len(text)) if text[k - 1] and text[k])
    stop = text[i - 1][-1] + text[i][0]  # spans the boundary between two tokens' text
    cut = "".join(text).find(stop)
    starts = np.cumsum([0] + [len(t) for t in text])[:-1]
    want = [t for t, at in zip(toks, starts) if at < cut]
    r = oa.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "".join(text)[:cut]
    assert [bytes(e.bytes) for e in r.choices[0].logprobs.content] == want
    streamed = [bytes(e.bytes) for c in oa.chat.completions.create(**kw, stop=[stop], stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == want


def test_anthropic_prefill_continues_the_reply(an, engine):
    """A last assistant message is the start of the reply: the prompt ends with it, open (no
    end of sentence, no new assistant turn), and the answer continues it; with thinking on too
    (the prefilled turn closes the thinking, so the answer is text)."""
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Sure"}]
    ids = chat_ids(tok, "Hello", think=False) + tok.encode("Sure")
    m = an.messages.create(model="ds4", max_tokens=N, messages=msgs, extra_body=T0)
    assert m.content[0].type == "text" and m.content[0].text == tok.decode(greedy_ids(engine, ids, N))
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ids)
    assert an.messages.count_tokens(model="ds4", messages=msgs).input_tokens == len(ids)
    ids = chat_ids(tok, "Hello", think=True) + [tok.think_end_id] + tok.encode("Sure")
    m = an.messages.create(model="ds4", max_tokens=N, messages=msgs, extra_body=T0,
                           thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == tok.decode(greedy_ids(engine, ids, N))


def test_a_model_is_retrieved_by_its_id(server, oa):
    label = 'ds4_requests_total{endpoint="/v1/models/{model:path}",status="%d"}'
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    before = {code: metric(server.url, label % code, AUTH) if label % code in text else 0 for code in (200, 404)}
    listed = oa.models.list().data
    assert oa.models.retrieve(listed[0].id).id == listed[0].id
    with pytest.raises(openai.NotFoundError, match="no model 'another'"):
        oa.models.retrieve("another")
    # counted under the route, not "other" (a client still adds no series: one label for any id)
    assert {code: metric(server.url, label % code, AUTH) for code in (200, 404)} == \
        {200: before[200] + 1, 404: before[404] + 1}


def test_prefix_reuse_equals_cold(oa, an, engine):
    tok = engine.tokenizer
    first = [{"role": "user", "content": "Hello there"}]
    a = oa.chat.completions.create(model="ds4", messages=first, max_tokens=N, temperature=0,
                                   reasoning_effort="none")
    history = first + [{"role": "assistant", "content": a.choices[0].message.content},
                       {"role": "user", "content": "Again"}]
    b = oa.chat.completions.create(model="ds4", messages=history, max_tokens=N, temperature=0,
                                   reasoning_effort="none")
    held = a.usage.prompt_tokens + a.usage.completion_tokens
    assert b.usage.prompt_tokens_details.cached_tokens == held
    # cold, in this process: the first prompt, its greedy reply's ids, then the new turn
    ids_a = chat_ids(tok, "Hello there", think=False)
    reply = greedy_ids(engine, ids_a, N)
    assert tok.decode(reply) == a.choices[0].message.content
    ids_b = ids_a + reply + [tok.eos_id, tok.user_id] + tok.encode("Again") + [tok.assistant_id, tok.think_end_id]
    assert b.usage.prompt_tokens == len(ids_b)
    assert b.choices[0].message.content == tok.decode(greedy_ids(engine, ids_b, N))
    # the Anthropic API reports the reuse as cache reads
    c = an.messages.create(model="ds4", max_tokens=N, extra_body=T0, messages=history + [
        {"role": "assistant", "content": b.choices[0].message.content},
        {"role": "user", "content": "More"}])
    assert c.usage.cache_read_input_tokens == len(ids_b) + N
    assert c.usage.input_tokens + c.usage.cache_read_input_tokens > len(ids_b) + N


def test_think_mode_chat_reuses_the_prompt_snapshot(oa, engine):
    """A think-mode history drops the past reasoning (from the generation prompt's <think> on),
    so the session's tokens are not a prefix of the next prompt; the snapshot of the previous
    prompt less that token is, and the text equals a cold session's."""
    tok = engine.tokenizer
    first = [{"role": "user", "content": "Think about it"}]
    a = oa.chat.completions.create(model="ds4", messages=first, max_tokens=N, temperature=0)
    answer = a.choices[0].message.content
    b = oa.chat.completions.create(model="ds4", temperature=0, max_tokens=N, messages=first + [
        {"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}])
    ids_a = chat_ids(tok, "Think about it", think=True)
    ids_b = (ids_a[:-1] + [tok.think_end_id] + tok.encode(answer) + [tok.eos_id, tok.user_id]
             + tok.encode("And?") + [tok.assistant_id, tok.think_start_id])
    assert b.usage.prompt_tokens == len(ids_b)
    assert b.usage.prompt_tokens_details.cached_tokens == len(ids_a) - 1
    assert b.choices[0].message.model_extra["reasoning_content"] == tok.decode(greedy_ids(engine, ids_b, N))


def test_logprobs(oa, engine):
    tok = engine.tokenizer
    r = oa.chat.completions.create(model="ds4", messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=3, temperature=0, reasoning_effort="none",
                                   logprobs=True, top_logprobs=2)
    entries = r.choices[0].logprobs.content
    s = engine.session(ctx=1024)
    s.sync(chat_ids(tok, "Hi", think=False))
    assert len(entries) == 3
    for e in entries:
        x = s.logits.astype(np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        best = np.argsort(-lp, kind="stable")[:2]
        assert e.token == tok.token_bytes(int(best[0])).decode("utf-8", errors="replace")
        assert e.logprob == pytest.approx(lp[best[0]], abs=1e-5)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(lp[best].tolist(), abs=1e-5)
        s.eval(int(best[0]))


def test_raw_completions(oa, engine):
    tok = engine.tokenizer
    prompt = "<｜begin▁of▁sentence｜>Once upon a time"
    r = oa.completions.create(model="ds4", prompt=prompt, max_tokens=3, temperature=0)
    ids = tok.encode_rendered(prompt)
    assert r.choices[0].text == tok.decode(greedy_ids(engine, ids, 3))
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].finish_reason == "length"


def test_completion_logprobs_have_text_offsets(oa):
    """Legacy logprobs give each token's character offset in the returned text, streamed or not."""
    kw = dict(model="ds4", prompt="<｜begin▁of▁sentence｜>Once upon a time", max_tokens=3, temperature=0, logprobs=2)
    lp = oa.completions.create(**kw).choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.top_logprobs) == 3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(3)]
    chunks = [c.choices[0].logprobs for c in oa.completions.create(**kw, stream=True)
              if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset


def test_tool_history_renders_in_ds4_format(oa, an, engine):
    """An assistant tool call and its result, sent by each client, become the DSML block and the
    <tool_result> turn written out here by hand from spec §5."""
    from ds4.serve.tools import ToolSpec, render_tool_prompt

    tok = engine.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    oa_tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                   "parameters": schema}}]
    oa_msgs = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = ("<｜begin▁of▁sentence｜>" + render_tool_prompt([ToolSpec("get_weather", "Weather", schema)])
            + "<｜User｜>Weather in Paris?<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n"
            '<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
            "<｜User｜><tool_result>sunny</tool_result><｜Assistant｜></think>")
    want = len(tok.encode_rendered(text))
    r = oa.chat.completions.create(model="ds4", messages=oa_msgs, tools=oa_tools, max_tokens=1,
                                   temperature=0, reasoning_effort="none")
    assert r.usage.prompt_tokens == want
    an_msgs = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris", "days": 2}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": "sunny"}]}]
    an_tools = [{"name": "get_weather", "description": "Weather", "input_schema": schema}]
    assert an.messages.count_tokens(model="ds4", messages=an_msgs, tools=an_tools).input_tokens == want


def test_invalid_requests_400(server, oa, an):
    msgs = [{"role": "user", "content": "x"}]
    cases = [({"temperature": 5}, "temperature"), ({"n": 2}, "n"),
             # (what this server does not do is refused, not ignored)
             ({"response_format": {"type": "json_object"}}, "response_format"),
             ({"logit_bias": {"5": 10}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
             ({"frequency_penalty": -1}, "frequency_penalty"),
             ({"max_tokens": 100000}, "max_tokens"), ({"top_p": -0.1}, "top_p"),
             ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
             # (fields of OpenAI's this server would ignore, and a tool_choice without tools, as
             # OpenAI refuses it)
             ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": "bogus"}, "tool_choice"),
             ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
             ({"function_call": "auto"}, "function_call"), ({"modalities": ["text", "audio"]}, "modalities"),
             ({"parallel_tool_calls": False, "tools": [{"type": "function", "function": {"name": "f"}}]},
              "parallel_tool_calls"),
             ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "tools[0].function.name"),
             # (a number or a boolean sent as a string is the wrong type, as OpenAI answers it)
             ({"max_tokens": "2"}, "max_tokens"), ({"temperature": "0.5"}, "temperature"),
             ({"max_tokens": 2.0}, "max_tokens"),
             ({"stream_options": {"include_usage": True}}, "stream_options"),  # (without stream)
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(**{"model": "ds4", "messages": msgs, "max_tokens": 1, **extra})
        assert e.value.status_code == 400 and e.value.body["param"] == param, (extra, e.value.body)
        assert param.split("[")[0] in e.value.body["message"]
    for extra, param in (({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"),
                         ({"logit_bias": {"1": 1}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(**{"model": "ds4", "prompt": "x", "max_tokens": 1, **extra})
        assert e.value.status_code == 400 and e.value.body["param"] == param, (extra, e.value.body)
    # (the same fields asking for nothing are fine)
    r = oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=1, temperature=0,
                                   response_format={"type": "text"}, logit_bias={}, presence_penalty=0,
                                   frequency_penalty=0)
    assert r.usage.completion_tokens == 1
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=1, messages=msgs, extra_body={"temperature": 3})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=1, messages=[{"role": "system", "content": "x"}])
    assert "messages[0].role" in e.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:  # (it was dropped without a word)
        an.messages.create(model="ds4", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "x"}, image]}]}])
    assert e.value.body["error"]["message"].startswith("messages[0].content[0].content[1].type: expected text")
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
    for extra, field in (({"tool_choice": {"type": "any"}}, "tool_choice"),
                         ({"tools": tools, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
                         ({"tools": [{"name": 5}], "tool_choice": {"type": "none"}}, "tools[0].name")):
        with pytest.raises(anthropic.BadRequestError) as e:
            an.messages.create(model="ds4", max_tokens=1, messages=msgs, **extra)
        assert e.value.body["error"]["message"].startswith(f"{field}: "), (extra, e.value.body)
    for path, body in (("/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "stream": "yes"}),
                       ("/v1/messages", {"messages": msgs, "max_tokens": "3"}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": True})):
        r = httpx.post(f"{server.url}{path}", headers=AUTH, json=body)
        field = next(k for k, v in body.items() if isinstance(v, (str, bool)) and k not in ("prompt",))
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(f"{field}: Input should be a valid"), (path, message)
    # (parallel tool calls on and a text-only modality are what this server does anyway)
    r = oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=1, temperature=0,
                                   parallel_tool_calls=True, modalities=["text"],
                                   tools=[{"type": "function", "function": {"name": "f"}}])
    assert r.usage.completion_tokens == 1
    r = httpx.post(f"{server.url}/v1/messages", headers={**AUTH, "content-type": "application/json"},
                   content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json={"messages": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    big = b'{"messages": [], "pad": "' + b"x" * (9 << 20) + b'"}'
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={**AUTH, "content-type": "application/json"},
                   content=big)
    assert r.status_code == 413 and "error" in r.json()


def test_wrong_types_inside_a_request_400(oa, an):
    """A value of the wrong type deep in a request (a block's text, a tool_choice's name) is a
    400 in the API's own error JSON that names its path, the type expected and the one sent."""
    user = [{"role": "user", "content": "x"}]
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
    an_cases = [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text", "number 5"),
        ({"messages": user, "system": [{"type": "text", "text": 5}]}, "system[0].text", "number 5"),
        ({"messages": user + [{"role": "assistant", "content": [
            {"type": "thinking", "thinking": None, "signature": ""}]}]},
         "messages[1].content[0].thinking", "null"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                     "content": [{"type": "text", "text": 3}]}]}]},
         "messages[0].content[0].content[0].text", "number 3"),
        ({"messages": user, "tools": tools, "tool_choice": {"type": "tool", "name": ["f"]}},
         "tool_choice.name", 'array ["f"]'),
    ]
    for kwargs, param, sent in an_cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            an.messages.create(model="ds4", max_tokens=1, **kwargs)
        assert e.value.status_code == 400 and e.value.body["type"] == "error", (param, e.value.body)
        assert e.value.body["error"] == {"type": "invalid_request_error",
                                         "message": f"{param}: Input should be a valid string, got {sent}"}
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.count_tokens(model="ds4", messages=[
            {"role": "user", "content": [{"type": "text", "text": None}]}])
    assert e.value.body["error"]["message"] == \
        "messages[0].content[0].text: Input should be a valid string, got null"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="ds4", max_tokens=1, messages=user,
                                   tools=[{"type": "function", "function": {"name": "f"}}],
                                   tool_choice={"type": "function", "function": {"name": ["f"]}})
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == "tool_choice.function.name"
    assert e.value.body["message"] == \
        'tool_choice.function.name: Input should be a valid string, got array ["f"]'


def test_a_value_that_fits_no_member_of_a_union_names_the_field(oa, an):
    """A field of several kinds (stop, system) is named as itself with the kinds it takes, not by
    pydantic's member ("stop.str"); a member of the value's kind that fails further in names that
    place."""
    user = [{"role": "user", "content": "x"}]
    for stop, param, message in ((5, "stop", "stop: expected a string or an array, got number 5"),
                                 ([1], "stop[0]", "stop[0]: Input should be a valid string, got number 1")):
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="ds4", max_tokens=1, messages=user, stop=stop)
        assert (e.value.body["param"], e.value.body["message"]) == (param, message)
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="ds4", max_tokens=1, messages=user, system=5)
    assert e.value.body["error"]["message"] == "system: expected a string or an array, got number 5"


def test_a_chunked_body_over_the_limit_413(server):
    """The body limit counts the bytes received: h11 reads a chunked body as chunked whatever
    Content-Length came with it, so a small Content-Length does not let a large body in."""
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                       "pad": "x" * MAX_BODY}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    for path in ("/v1/chat/completions", "/v1/messages"):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request("POST", path, body=chunked, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                "Content-Length": "2", "Transfer-Encoding": "chunked"})
            r = conn.getresponse()
            status, answer = r.status, json.loads(r.read())
        finally:
            conn.close()
        assert status == 413, (path, answer)
        error = answer["error"]
        assert error["type"] == ("request_too_large" if path == "/v1/messages" else "invalid_request_error")
        assert f"more than {MAX_BODY} bytes" in error["message"]


def test_a_chunked_body_without_a_length_is_served_up_to_the_limit(server):
    """A body sent in chunks without a Content-Length (httpx with a generator) is read: it was
    refused with 411; past the limit it is still a 413."""
    def chunks(body: bytes):
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    small = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                        "temperature": 0}).encode()
    big = json.dumps({"messages": [{"role": "user", "content": "x" * MAX_BODY}], "max_tokens": 1}).encode()
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = httpx.post(f"{server.url}{path}", content=chunks(small), headers=headers, timeout=60)
        assert r.status_code == 200, (path, r.text)
        assert "content-length" not in r.request.headers
        r = httpx.post(f"{server.url}{path}", content=chunks(big), headers=headers, timeout=60)
        assert r.status_code == 413, (path, r.text)


def test_openai_nulls_are_the_defaults_and_a_seed_is_any_int64(oa):
    """As OpenAI's API: an optional field sent as null (the official client sends null for an
    argument given as None) has its default, and a seed may be negative (an int64): the engine
    takes its 64 bits."""
    msgs = [{"role": "user", "content": "Hi"}]
    r = oa.chat.completions.create(
        model="ds4", messages=msgs, max_tokens=N, temperature=None, top_p=None, n=None, stream=None,
        logprobs=None, top_logprobs=None, stop=None, seed=None, user=None, tools=None,
        tool_choice=None, stream_options=None, max_completion_tokens=None, reasoning_effort=None,
        extra_body={"top_k": None, "min_p": None, "thinking": None})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N
    c = oa.completions.create(model="ds4", prompt="Once", max_tokens=1, temperature=None, top_p=None,
                              n=None, stream=None, logprobs=None, echo=None, seed=None, stop=None)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 1
    texts = [oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=N, temperature=1,
                                        reasoning_effort="none", seed=seed).choices[0].message.content
             for seed in (-5, (1 << 64) - 5)]
    assert texts[0] == texts[1]
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=1, seed=-(1 << 63) - 1)
    assert e.value.body["param"] == "seed"


def test_auth_401(server):
    bad_oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_oa.models.list()
    bad_an = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_an.messages.create(model="ds4", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                   json={"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "temperature": 0})
    assert r.status_code == 200  # x-api-key works as well as the bearer header


def test_queue_full_429_and_disconnect_cancels(server, oa):
    url = server.url
    wait_idle(url, AUTH)
    cancelled0 = metric(url, "ds4_cancelled_generations_total", AUTH)
    generated0 = metric(url, "ds4_generated_tokens_total", AUTH)
    t0 = time.monotonic()
    long = oa.chat.completions.create(model="ds4", messages=[{"role": "user", "content": "long"}],
                                      max_tokens=500, temperature=0, reasoning_effort="none", stream=True)
    next(iter(long))  # generating now
    # a second request waits in the queue of one (its client hangs up while it waits)
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"messages": [{"role": "user", "content": "q"}], "max_tokens": 2}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while metric(url, "ds4_queue_depth", AUTH) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as e:
        oa.chat.completions.create(model="ds4", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert int(e.value.response.headers["retry-after"]) >= 1
    sock.close()
    time.sleep(1.0)  # the server notices the waiting client's hang-up (it polls) before A ends
    long.close()  # the client goes away: the generation stops at its next token
    held = time.monotonic() - t0  # how long the client was there
    wait_idle(url, AUTH)
    assert metric(url, "ds4_cancelled_generations_total", AUTH) == cancelled0 + 1
    generated = metric(url, "ds4_generated_tokens_total", AUTH) - generated0
    # it stopped within a second of the hang-up (its decode time, from the decode speed it
    # reports, fits in the time the client was there), long before its 500 tokens: a bound in
    # time, not in tokens, which a faster machine generates more of in the same second
    decode_s = generated / metric(url, "ds4_decode_tokens_per_second", AUTH)
    assert generated < 500 and decode_s < held + 1.0, (generated, decode_s, held)
    # and the server serves again
    r = oa.chat.completions.create(model="ds4", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_a_request_not_streamed_stops_when_its_client_leaves(server):
    """A client that hangs up on a request it did not stream stops the generation within a
    token or so: the server looks for it at each token, not only when no token came for a
    while (tokens that come faster than that kept a gone client's generation to its end)."""
    url = server.url
    wait_idle(url, AUTH)
    cancelled0 = metric(url, "ds4_cancelled_generations_total", AUTH)
    generated0 = metric(url, "ds4_generated_tokens_total", AUTH)
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"messages": [{"role": "user", "content": "long"}], "max_tokens": 500,
                       "temperature": 0, "reasoning_effort": "none"}).encode()
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while metric(url, "ds4_generations_running", AUTH) < 1:  # generating now
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.5)  # (a few tokens in)
    sock.close()
    held = time.monotonic() - t0
    wait_idle(url, AUTH)
    assert metric(url, "ds4_cancelled_generations_total", AUTH) == cancelled0 + 1
    generated = metric(url, "ds4_generated_tokens_total", AUTH) - generated0
    # a bound in time, as in the streamed case: its decode time fits in the time the client was there
    decode_s = generated / metric(url, "ds4_decode_tokens_per_second", AUTH)
    assert generated < 500 and decode_s < held + 0.5, (generated, decode_s, held)


def test_sigterm_ends_open_streams_with_an_error_event(tmp_path):
    """Ctrl-C / SIGTERM: a stream under way ends with an error event saying why (its client
    knows the reply is cut), and the server exits cleanly within the grace period."""
    import signal

    proc = Proc(["serve", "--port", "0", "--backend", "reference", "--ctx", "1024"], tmp_path / "serve.log")
    try:
        proc.wait_listening().wait_healthy()
        oa = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="-", max_retries=0, timeout=60)
        stream = oa.chat.completions.create(model="ds4", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=1000, temperature=0, stream=True)
        it = iter(stream)
        next(it)
        proc.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                pass
        assert "shutting down" in str(e.value.message)
        assert proc.proc.wait(timeout=30) in (0, 128 + signal.SIGTERM)  # (uvicorn re-raises the signal)
        assert "Traceback" not in (tmp_path / "serve.log").read_text()
    finally:
        proc.kill()
