"""`ds4 serve --split-next`: the HTTP head of a pipeline, and what it does when its worker dies
mid-stream (an error event ends the stream, 503 while the worker is away, served again once it
is back, with no restart of the server). Driven by the official openai client. Both run over TLS
(the server's TLS options reach its link to the other process)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from serve_helpers import Proc

N = 3


def test_split_worker_dies_and_returns(tmp_path, certs):
    stage = ["3:6", "--backend", "reference", "--ctx", "1024",
             "--tls-cert", str(certs / "cert.pem"), "--tls-key", str(certs / "key.pem")]
    worker = Proc(["pipe-worker", "0", *stage], tmp_path / "worker.log").wait_listening()
    port = worker.port
    server = Proc(["serve", "--port", "0", "--backend", "reference", "--ctx", "1024",
                   "--split-next", f"127.0.0.1:{port}", "--layers", "0:3", "--tls-ca", str(certs / "cert.pem")],
                  tmp_path / "serve.log")
    try:
        server.wait_listening().wait_healthy()
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Hello"}]
        kw = dict(model="ds4", messages=msgs, max_tokens=N, temperature=0, reasoning_effort="none")
        first = oa.chat.completions.create(**kw).choices[0].message.content

        stream = oa.chat.completions.create(**{**kw, "max_tokens": 400}, stream=True)
        it = iter(stream)
        next(it)
        worker.kill()
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                pass
        assert "pipeline" in str(e.value.message) or "next stage" in str(e.value.message)

        with pytest.raises(openai.InternalServerError) as e:
            oa.chat.completions.create(**kw)
        assert e.value.status_code == 503 and e.value.type == "api_error"  # (an OpenAI type)
        assert httpx.get(f"{server.url}/health").status_code == 503

        worker = Proc(["pipe-worker", str(port), *stage], tmp_path / "worker2.log").wait_listening()
        assert httpx.get(f"{server.url}/health").status_code == 200  # it reached the worker again
        again = oa.chat.completions.create(**kw)
        assert again.choices[0].message.content == first
    finally:
        server.kill()
        worker.kill()


def test_tensor_parallel_worker_dies_and_rejoins(tmp_path, certs):
    """`ds4 serve --tp-listen`: the same promises with a `ds4 tp-worker` as the other rank."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tp = ["--backend", "reference", "--numerics", "exact"]
    server = Proc(["serve", "--port", "0", "--ctx", "1024", *tp, "--tp-listen", f"127.0.0.1:{port}",
                   "--tp-wait", "60", "--gate-timeout-ms", "5000",
                   "--tls-cert", str(certs / "cert.pem"), "--tls-key", str(certs / "key.pem")], tmp_path / "serve.log")
    tp_worker = ["tp-worker", "--leader", f"127.0.0.1:{port}", *tp, "--tls-ca", str(certs / "cert.pem")]
    worker = Proc(tp_worker, tmp_path / "worker.log")
    try:
        server.wait_listening().wait_healthy()
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Hello"}]
        kw = dict(model="ds4", messages=msgs, max_tokens=N, temperature=0, reasoning_effort="none")
        first = oa.chat.completions.create(**kw).choices[0].message.content

        stream = oa.chat.completions.create(**{**kw, "max_tokens": 400}, stream=True)
        it = iter(stream)
        next(it)
        worker.kill()
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                pass
        assert "tensor parallel failed during" in str(e.value.message)  # (decode, or between two steps)

        quick = oa.with_options(timeout=20)  # well under --tp-wait: a 503 at once, no wait for a worker
        with pytest.raises(openai.InternalServerError) as e:
            quick.chat.completions.create(**kw)
        assert e.value.status_code == 503
        assert httpx.get(f"{server.url}/health").status_code == 503

        worker = Proc(tp_worker, tmp_path / "worker2.log")
        server.wait_healthy()  # the probe took the worker back
        again = oa.chat.completions.create(**kw)
        assert again.choices[0].message.content == first

        worker.kill()  # now while no request runs: /health and the next request see it
        deadline = time.monotonic() + 20  # (the last request's thread may still be finishing)
        while httpx.get(f"{server.url}/health", timeout=20).status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 after the worker left"
            time.sleep(0.1)
        with pytest.raises(openai.InternalServerError) as e:
            quick.chat.completions.create(**kw)
        assert e.value.status_code == 503 and "away" in str(e.value.message)
        worker = Proc(tp_worker, tmp_path / "worker3.log")
        server.wait_healthy()
        assert oa.chat.completions.create(**kw).choices[0].message.content == first
    finally:
        server.kill()
        worker.kill()
