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
"""

from __future__ import annotations

import ipaddress
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
