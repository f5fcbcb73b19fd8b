"""HOST:PORT, read by one rule wherever ds4 takes a network address (the commands' options, the
pipeline's `next_addr`).

    parse_hostport("node-b:7000", "--send-kv")                    -> ("node-b", 7000)
    parse_hostport("[::1]:9000", "--next")                        -> ("::1", 9000)
    parse_hostport(":7000", "--send-kv", default_host=LOOPBACK)   -> ("127.0.0.1", 7000)
    parse_hostport("0.0.0.0:0", "--tp-listen", any_port=True)     -> ("0.0.0.0", 0)

An IPv6 host goes in brackets: its colons would otherwise run into the port's ("::1:9000" is
refused, naming the bracketed form). A port is 1..65535; `any_port` also takes 0, for an address
a command listens on, where 0 asks the system for a free port. ":PORT" (no host) is read only
where the caller gives `default_host`, for a command whose documented form allows it. A refused
address is an `AddressError` naming the option, the form it takes and the value it got.

Every listener binds with `listen_socket`, so a port in use or a host that is no address of this
machine is one `ListenError`, `cannot listen on HOST:PORT: reason`, whichever listener it is.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

LOOPBACK = "127.0.0.1"  # the host of ":PORT" where a command takes that form
MIN_PORT = 1
MAX_PORT = 65535
ANY_PORT = 0  # a listener's "any free port"


class AddressError(ValueError):
    """An address that is not HOST:PORT as the option takes it. `detail` is the message without
    the option's name, for a command line parser that names the option itself."""

    def __init__(self, name: str, expected: str, value: str, why: str):
        self.name, self.expected, self.value, self.why = name, expected, value, why
        self.detail = f"expected {expected}, got {value!r} ({why})"
        super().__init__(f"{name}: {self.detail}")


def expected_form(*, default_host: str | None = None, any_port: bool = False) -> str:
    """The form an option takes, as its errors say it."""
    form = "HOST:PORT or :PORT" if default_host is not None else "HOST:PORT"
    low = ANY_PORT if any_port else MIN_PORT
    return f"{form} (a port in {low}..{MAX_PORT}; an IPv6 host in brackets, [::1]:PORT)"


def parse_hostport(text: str, name: str = "address", *, default_host: str | None = None,
                   any_port: bool = False) -> tuple[str, int]:
    """`text` as (host, port), or an AddressError naming `name` (the option or field).

    default_host: the host of ":PORT" (None: a host is required). any_port: take port 0 too."""

    def refuse(why: str) -> AddressError:
        return AddressError(name, expected_form(default_host=default_host, any_port=any_port),
                            text, why)

    if not isinstance(text, str):
        raise refuse("not a string")
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise refuse("the '[' of an IPv6 host has no ']'")
        host, after = text[1:close], text[close + 1:]
        if not after.startswith(":"):
            raise refuse("no ':PORT' after the bracketed host")
        port_text = after[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise refuse(f"{host!r} in brackets is not an IPv6 address") from None
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise refuse("no port")
        if ":" in host:
            raise refuse(f"an IPv6 host goes in brackets: [{host}]:{port_text}")
        if "[" in host or "]" in host:
            raise refuse("brackets go only around a whole IPv6 host")
        if not host:
            if default_host is None:
                raise refuse("no host")
            host = default_host
    if not port_text:
        raise refuse("no port")
    # (isascii: str.isdigit also takes other scripts' digits, which int() would read)
    if not (port_text.isascii() and port_text.isdigit()):
        raise refuse(f"the port {port_text!r} is not a number")
    port = int(port_text)
    low = ANY_PORT if any_port else MIN_PORT
    if not low <= port <= MAX_PORT:
        raise refuse(f"the port {port} is not in {low}..{MAX_PORT}")
    return host, port


def format_hostport(host: str, port: int) -> str:
    """(host, port) as HOST:PORT, an IPv6 host in brackets: what parse_hostport reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_family(host: str) -> socket.AddressFamily:
    """The address family to listen on `host` (as parse_hostport gives it): an IPv6 literal
    needs an IPv6 socket (socket.create_server's default family is IPv4); a name or an IPv4
    address takes IPv4, as before."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# the errors of bind() that are the host's, not the port's: a name that does not resolve (any
# getaddrinfo error), an address that is not this machine's, an address family it lacks
_HOST_ERRNOS = frozenset({errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT})


class ListenError(OSError):
    """A listener that could not bind or listen on HOST:PORT. str(): `cannot listen on
    HOST:PORT: reason` (an IPv6 host in brackets; the system's reason without its errno, which
    stays in `errno`). `host_fault`: the host is what failed (it does not resolve, or is not an
    address of this machine), so a command can name the option that gave the host rather than
    the port's."""

    def __init__(self, host: str, port: int, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause) or type(cause).__name__)
        self.host, self.port = host, port
        self.host_fault = isinstance(cause, socket.gaierror) or cause.errno in _HOST_ERRNOS

    def __str__(self) -> str:
        return f"cannot listen on {format_hostport(self.host, self.port)}: {self.strerror}"


def listen_socket(host: str, port: int, backlog: int | None = None, *,
                  v6only: bool | None = None) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (port 0: a free one). SO_REUSEADDR is
    set (except on Windows, where it would let another socket take the port), so a restarted
    listener gets back a port whose old connections linger in TIME_WAIT. `v6only`, for an IPv6
    host: accept IPv6 only (True), IPv4 too (False), or as the system does (None). Any failure is
    a ListenError naming the address."""
    try:
        sock = socket.socket(listen_family(host), socket.SOCK_STREAM)
    except OSError as e:
        raise ListenError(host, port, e) from None
    try:
        if os.name not in ("nt", "cygwin"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if v6only is not None and sock.family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind((host, port))
        if backlog is None:
            sock.listen()
        else:
            sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ListenError(host, port, e) from None
    except BaseException:
        sock.close()
        raise
    return sock
