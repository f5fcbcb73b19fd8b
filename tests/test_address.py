"""HOST:PORT, read by one rule (ds4/wire/address.py) for every command and the pipeline library:
the forms it takes, the errors it gives (the option, the form it takes, the value it got, why),
and each command's own rule on the command line (":PORT" where a command documents it, port 0
where a command listens)."""

from __future__ import annotations

import errno
import re
import socket

import pytest
from typer.testing import CliRunner

from ds4.wire import ds4k
from ds4.wire.address import AddressError, ListenError, format_hostport, listen_socket, parse_hostport

from cli.main import app

LOOPBACK = "127.0.0.1"
FORM = "HOST:PORT (a port in 1..65535; an IPv6 host in brackets, [::1]:PORT)"
FORM_DEFAULT_HOST = "HOST:PORT or :PORT (a port in 1..65535; an IPv6 host in brackets, [::1]:PORT)"
FORM_ANY_PORT = "HOST:PORT (a port in 0..65535; an IPv6 host in brackets, [::1]:PORT)"


@pytest.mark.parametrize("text, options, want", [
    ("node-b:7000", {}, ("node-b", 7000)),
    ("10.0.0.2:1", {}, ("10.0.0.2", 1)),
    ("host:65535", {}, ("host", 65535)),
    ("host:0080", {}, ("host", 80)),
    ("[::1]:9000", {}, ("::1", 9000)),
    ("[2001:db8::7]:443", {}, ("2001:db8::7", 443)),
    ("[fe80::1%eth0]:9000", {}, ("fe80::1%eth0", 9000)),
    (":7000", {"default_host": LOOPBACK}, (LOOPBACK, 7000)),
    ("node-b:7000", {"default_host": LOOPBACK}, ("node-b", 7000)),
    ("0.0.0.0:0", {"any_port": True}, ("0.0.0.0", 0)),
    ("[::]:0", {"any_port": True}, ("::", 0)),
])
def test_the_forms_an_address_takes(text, options, want):
    assert parse_hostport(text, "--opt", **options) == want
    assert parse_hostport(format_hostport(*want), "--opt", **options) == want


@pytest.mark.parametrize("text, options, form, why", [
    ("localhost", {}, FORM, "no port"),
    ("host:", {}, FORM, "no port"),
    (":7000", {}, FORM, "no host"),
    ("host:0", {}, FORM, "the port 0 is not in 1..65535"),
    ("host:0", {"default_host": LOOPBACK}, FORM_DEFAULT_HOST, "the port 0 is not in 1..65535"),
    ("host:65536", {}, FORM, "the port 65536 is not in 1..65535"),
    ("host:70000", {"any_port": True}, FORM_ANY_PORT, "the port 70000 is not in 0..65535"),
    ("host:x", {}, FORM, "the port 'x' is not a number"),
    ("host:-1", {}, FORM, "the port '-1' is not a number"),
    ("host:\u0663", {}, FORM, "the port '\u0663' is not a number"),  # (an Arabic-Indic digit 3)
    ("::1:9000", {}, FORM, "an IPv6 host goes in brackets: [::1]:9000"),
    ("::1:9000", {"default_host": LOOPBACK}, FORM_DEFAULT_HOST,
     "an IPv6 host goes in brackets: [::1]:9000"),
    ("[::1:9000", {}, FORM, "the '[' of an IPv6 host has no ']'"),
    ("[::1]9000", {}, FORM, "no ':PORT' after the bracketed host"),
    ("[::1]", {}, FORM, "no ':PORT' after the bracketed host"),
    ("[::1]:", {}, FORM, "no port"),
    ("[localhost]:80", {}, FORM, "'localhost' in brackets is not an IPv6 address"),
    ("[]:80", {}, FORM, "'' in brackets is not an IPv6 address"),
    ("a]:80", {}, FORM, "brackets go only around a whole IPv6 host"),
])
def test_a_refused_address_names_the_option_the_form_and_the_value(text, options, form, why):
    with pytest.raises(AddressError) as e:
        parse_hostport(text, "--opt", **options)
    assert str(e.value) == f"--opt: expected {form}, got {text!r} ({why})"
    assert e.value.detail == f"expected {form}, got {text!r} ({why})"
    assert isinstance(e.value, ValueError)  # (what the commands' library_errors report)


def test_an_address_that_is_not_a_string_is_refused():
    with pytest.raises(AddressError, match=r"^next_addr: expected HOST:PORT .* \(not a string\)$"):
        parse_hostport(9000, "next_addr")


# ---- each command's rule on the command line ------------------------------------------------------

pytestmark = pytest.mark.usefixtures("private_cache")



def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("args, option, value, why", [
    (["prefill", "-p", "hi", "--send-kv", "::1:7000"], "--send-kv", "::1:7000",
     "an IPv6 host goes in brackets: [::1]:7000"),
    (["kv-send", "x.dsv4", "host:0"], "HOST:PORT", "host:0", "the port 0 is not in 1..65535"),
    (["generate", "-p", "hi", "--split-next", ":9000", "--layers", "0:2"], "--split-next", ":9000",
     "no host"),
    (["pipe-worker", "0", "2:5", "--next", "[::1]9000"], "--next", "[::1]9000",
     "no ':PORT' after the bracketed host"),
    (["generate", "-p", "hi", "--tp-listen", "nohost"], "--tp-listen", "nohost", "no port"),
    (["tp-worker", "--leader", "127.0.0.1:0", "--connect-timeout", "0.1"], "--leader", "127.0.0.1:0",
     "the port 0 is not in 1..65535"),
])
def test_every_address_option_is_a_command_line_error_naming_it(args, option, value, why):
    """Every command refuses a bad address the same way, before any work: exit 2 and one line
    naming the option, the value and why (--tp-listen and --leader were exit 1, read by a
    parser of their own that took port 0 as a peer's; --split-next took '::1:9000')."""
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}': expected HOST:PORT" in r.stderr, r.stderr
    assert f"got {value!r} ({why})" in r.stderr, r.stderr
    assert "Traceback" not in r.output


def test_kv_commands_take_port_alone_for_this_machine(tmp_path):
    """`kv-send FILE :PORT` (and `prefill --send-kv :PORT`) send to this machine: the address is
    taken, and the command goes on to the file."""
    missing = tmp_path / "none.dsv4"
    r = run("kv-send", missing, ":9")
    assert r.exit_code == 1 and f"KV file not found: {missing}" in r.stderr, r.output


def test_tp_listen_port_0_listens_on_a_free_port_and_says_which(model_path):
    r = run("generate", "-m", model_path, "-p", "hi", "--backend", "reference",
            "--tp-listen", "127.0.0.1:0", "--tp-wait", "0.2")
    assert r.exit_code == 1, r.output  # (no worker came)
    m = re.search(r"waiting up to 0\.2 s for\s+`ds4 tp-worker --leader 127\.0\.0\.1:(\d+)`", r.stderr)
    assert m and int(m.group(1)) > 0, r.stderr


def test_an_ipv6_peer_is_named_in_brackets_in_errors():
    """Errors name an IPv6 peer as [HOST]:PORT, the form parse_hostport reads back (`::1:9000`
    is refused by it)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]  # (closed again: nothing listens there)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with pytest.raises(ds4k.DS4KError) as e:
        ds4k.probe_receiver("::1", port, timeout=1.0, connect_timeout=0.0)
    assert f"cannot connect to [::1]:{port}: " in str(e.value), str(e.value)
    assert parse_hostport(f"[::1]:{port}", "--send-kv") == ("::1", port)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_listeners_take_an_ipv6_host(model_path):
    """`--tp-listen [::1]:0` and a pipeline stage on ::1 listen on IPv6 loopback (both opened
    IPv4 sockets, which cannot bind an IPv6 address), and a client reaches the stage there."""
    if not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    r = run("generate", "-m", model_path, "-p", "hi", "--backend", "reference",
            "--tp-listen", "[::1]:0", "--tp-wait", "0.2")
    assert r.exit_code == 1, r.output  # (no worker came)
    m = re.search(r"for\s+`ds4 tp-worker --leader \[::1\]:(\d+)`", r.stderr)
    assert m and int(m.group(1)) > 0, r.stderr
    from bench_modules import bench_module
    from ds4.pipeline import Worker

    w = Worker(bench_module("pipeline", "bench_split").NullStage(64, 4), host="::1").start()
    try:
        with socket.create_connection(("::1", w.port), timeout=5.0) as c:
            assert c.family == socket.AF_INET6
    finally:
        w.stop()


@pytest.fixture
def busy_port():
    """A loopback port another socket listens on."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_listener_that_cannot_bind_names_the_address(busy_port):
    """listen_socket's one error: `cannot listen on HOST:PORT: reason` (the reason without its
    errno, an IPv6 host in brackets), and whether the host or the port is at fault."""
    with pytest.raises(ListenError) as e:
        listen_socket(LOOPBACK, busy_port)
    assert str(e.value) == f"cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    assert isinstance(e.value, OSError) and e.value.errno == errno.EADDRINUSE and not e.value.host_fault
    with pytest.raises(ListenError) as e:  # (a documentation address: no machine's own)
        listen_socket("192.0.2.1", 0)
    assert e.value.host_fault and str(e.value).startswith("cannot listen on 192.0.2.1:0: ")
    v6 = ListenError("::1", 7, OSError(errno.EADDRINUSE, "Address already in use"))
    assert str(v6) == "cannot listen on [::1]:7: Address already in use"
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert ListenError("nohost", 7, unknown).host_fault


def test_every_listening_command_names_its_option_and_the_address(model_path, busy_port):
    """A port in use is `error: OPTION: cannot listen on HOST:PORT: reason` from every command
    that listens (kv-recv and decode --recv-kv: test_ds4k.py), as serve said it (without the
    option): pipe-worker and --tp-listen printed Python's `[Errno 98] ... (while attempting to
    bind on address (...))`. A host that is not this machine's names --host."""
    want = f"cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    for args, option in [
        (["pipe-worker", busy_port, "1:5", "-m", model_path, "--backend", "reference"], "PORT"),
        (["generate", "-m", model_path, "-p", "hi", "--backend", "reference",
          "--tp-listen", f"127.0.0.1:{busy_port}", "--tp-wait", "0.2"], "--tp-listen"),
        (["serve", "-m", model_path, "--backend", "reference", "--port", busy_port], "--port"),
    ]:
        r = run(*args)
        assert r.exit_code == 1 and f"error: {option}: {want}" in r.stderr, (args, r.output)
        assert "Errno" not in r.output and "while attempting" not in r.output
    r = run("pipe-worker", 0, "1:5", "-m", model_path, "--backend", "reference", "--host", "192.0.2.1")
    assert r.exit_code == 1 and "error: --host: cannot listen on 192.0.2.1:0: " in r.stderr, r.output


@pytest.mark.parametrize("command", ["pipe-worker", "--tp-listen"])
def test_listening_commands_bind_before_they_load_the_model(tmp_path, busy_port, command):
    """pipe-worker and --tp-listen bind their port before they open the model (minutes for the
    real one): a port in use is their error even when the model is no GGUF at all."""
    not_a_model = tmp_path / "not-a-model.gguf"
    not_a_model.write_bytes(b"not a GGUF file\n" * 64)
    args, option = {
        "pipe-worker": (["pipe-worker", busy_port, "1:5", "-m", not_a_model, "--backend",
                         "reference"], "PORT"),
        "--tp-listen": (["generate", "-m", not_a_model, "-p", "hi", "--backend", "reference",
                         "--tp-listen", f"127.0.0.1:{busy_port}", "--tp-wait", "0.2"], "--tp-listen"),
    }[command]
    r = run(*args)
    want = f"error: {option}: cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    assert r.exit_code == 1 and want in r.stderr, r.output
