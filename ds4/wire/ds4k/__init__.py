"""DS4K: hand a DSV4 session payload to another node over TCP (wire.md §3).

    # decode node                                   # prefill node
    receive_payload(7411, "snap.dsv4",              send_payload("snap.dsv4", "10.0.0.2", 7411,
                    fingerprint=model.fingerprint)               fingerprint=model.fingerprint)

The payload travels byte for byte; the receiver checks the manifest before a payload byte moves,
streams to a temporary file beside the destination, verifies the SHA-256 (and the payload's
header, and with a model its exact size), fsyncs and renames. On any failure nothing is left at
the destination and the sender gets the reason.

Connection, sender = client, receiver = server; integers little-endian (inside TLS when the
receiver has `--tls-cert`, `ds4.wire.tls`):

0. client → server, opener (4 bytes): `u32 magic 0x4b345344 ("DS4K")`, the first bytes the
   sender sends on every connection (inside TLS: the first bytes inside it). The sender speaks
   first so that a receiver that requires TLS can tell a plain sender (these bytes) from a TLS
   one (a ClientHello, `ds4.wire.sniff`) before it answers; without it both would wait for the
   other until the io timeout.
1. server → client, hello (48 bytes):
   `u32 magic 0x4b345344 ("DS4K"), u32 version 3, u32 flags (bit0: the token must be proven),
   u32 0, 32-byte server nonce` (fresh random bytes per connection). Every receiver sends it at
   once, without waiting for the opener: a plain one as soon as it accepts, a TLS one as soon
   as the TLS handshake is done (before it, it only peeks at the first bytes, which a TLS
   sender's ClientHello fills at once). So an older sender, which sends nothing first, sees the
   version at once, with TLS or without. Then the receiver reads the opener (a plain one refuses
   a TLS ClientHello there). Instead of the hello, a receiver may send the reply record of
   step 3 with a non-zero status (its first u32 is a status, never the magic) and close: a
   receiver that requires TLS does so, with status TLS_MISMATCH, for a sender whose opener came
   in plain text.
   A sender that has a token refuses a receiver whose flags do not ask for it, sending nothing
   more.
2. client → server, record header (16 bytes):
   `u32 magic, u32 version 3, u32 flags (bit0: auth), u32 manifest_bytes` (≤ 64 KiB);
   if flags bit0: the 32-byte client nonce.
3. server → client, verdict on the header: `u32 status, u32 reason_bytes` + reason (UTF-8,
   ≤ 4 KiB); if status 0 and flags bit0: the 32-byte server proof (`ds4.wire.auth`, protocol
   b"DS4K"). Anything but status 0: the server closes the connection.
4. client → server: if flags bit0, the 32-byte client proof, sent only once the server proof
   checked out; then the manifest: `manifest_bytes` of UTF-8 JSON, one flat object with
   `fingerprint` (hex SHA-256 of the model, wire.md common rules, or null), `payload_bytes`,
   `sha256` (hex, of the payload), `n_tokens`, `ctx`, `version` (the payload's header fields)
   and `created` (unix seconds); nesting deeper than `MAX_MANIFEST_DEPTH` is refused unparsed.
5. server → client, manifest verdict, same record as 3 (no proof). Status 0: send the payload.
6. client → server: exactly `payload_bytes` bytes of payload, in chunks of any size.
7. server → client, final reply, same record as 5: status 0 once the file is in place.

Version 2 differs from version 1 (wire.md §3) in steps 2–4: both ends prove the token, the
receiver first, so a listener that does not know it learns nothing of the session. A refused
manifest (model, size, auth) is answered before the payload is streamed. Version 3 adds the
opener (step 0) and the refusal in place of the hello, so that a TLS mismatch fails at once on
both ends; a TLS sender facing a plain receiver gets its hello where a ServerHello belongs and
says that the receiver runs without TLS.

A probe is a record with `manifest_bytes` 0: steps 0–5 as above (the hello checked, the token
proven both ways), then the receiver answers step 5 with status 0 and closes; it is not a
failure and the receiver goes on waiting. A sender that has the payload still to make
(`ds4 prefill --send-kv`) probes first (`probe_receiver`), so that a dead host, a listener that
is not a DS4K receiver or a token mismatch fails before the work, not after it.

Deadlines: steps 0–5 must finish within the io timeout, and the payload within the io timeout
plus `payload_bytes / min_rate`, however the bytes trickle in. A receiver serves several
connections at once (up to `max_conns`); a bad, refused or slow one is logged and dropped while
the receiver keeps waiting for a payload until its own deadline.

The code, one part per job (this package re-exports every name, so `from ds4.wire import ds4k;
ds4k.send_payload` works): `records` (constants, status codes, `DS4KError`, `Manifest`, the
record I/O both ends share), `sender` (`send_payload`, `open_transfer`, `probe_receiver`) and
`receiver` (`Receiver`, `receive_payload`).
"""

from __future__ import annotations

from .records import (ACCEPT_POLL, ACCEPT_POLL_MIN, AUTH_FAILED, BAD_RECORD, CHUNK, CORRUPT,
                      DEFAULT_MAX_BYTES, DEFAULT_MAX_CONNS, DEFAULT_MIN_RATE, DEFAULT_TIMEOUT,
                      FLAG_AUTH, HELLO, INCOMPLETE, IO_ERROR, MAGIC, MAX_MANIFEST_BYTES,
                      MAX_MANIFEST_DEPTH, MAX_REASON_BYTES, NONCE_BYTES, OK, OPENER,
                      PROBE_CONNECT_TIMEOUT, PROBE_MANIFEST_BYTES, PROOF_BYTES, PROTOCOL, RECORD,
                      REFUSED, REPLY, STATUS_NAMES, TLS_MISMATCH, VERSION, DS4KError, Manifest,
                      _fingerprint_hex, _is_hex, _json_depth, _Probed, _read_reply, _recv_exact,
                      _send_reply)
from .sender import _connect, _handshake, make_manifest, open_transfer, probe_receiver, send_payload
from .receiver import Receiver, log, receive_payload

__all__ = [
    # records
    "MAGIC", "VERSION", "PROTOCOL", "FLAG_AUTH", "OPENER", "HELLO", "RECORD", "REPLY", "PROOF_BYTES",
    "NONCE_BYTES", "MAX_MANIFEST_BYTES", "MAX_MANIFEST_DEPTH", "MAX_REASON_BYTES",
    "DEFAULT_MAX_BYTES", "DEFAULT_TIMEOUT", "PROBE_CONNECT_TIMEOUT", "CHUNK", "DEFAULT_MIN_RATE",
    "DEFAULT_MAX_CONNS", "ACCEPT_POLL", "ACCEPT_POLL_MIN", "OK", "BAD_RECORD", "AUTH_FAILED",
    "REFUSED", "INCOMPLETE", "CORRUPT", "IO_ERROR", "TLS_MISMATCH", "STATUS_NAMES",
    "PROBE_MANIFEST_BYTES", "DS4KError", "Manifest",
    # sender
    "make_manifest", "probe_receiver", "open_transfer", "send_payload",
    # receiver
    "log", "Receiver", "receive_payload",
]
# the private names of the single module this package was, for the tests that reach into them
__all__ += ["_Probed", "_json_depth", "_is_hex", "_fingerprint_hex", "_recv_exact", "_send_reply",
            "_read_reply", "_connect", "_handshake"]
