"""DS4T's shared constants and errors: the magics, version, flag bits, the sanity bounds on any
hello, the three fixed structs (hello, frame header, gate header), the wire dtypes, and the
`DS4TError` family every other part of the package raises.
"""

from __future__ import annotations

import struct

import numpy as np


MAGIC = 0x44533454  # "DS4T": the hello
FRAME_MAGIC = 0x44533443  # "DS4C": a control frame
GATE_MAGIC = 0x44533447  # "DS4G": a gate record
REFUSAL_MAGIC = 0x44533452  # "DS4R": a refusal in place of the leader's hello (ds4.wire.refusal)
VERSION = 1
FLAG_AUTH = 1 << 0
FLAG_DEBUG_HASH = 1 << 1  # the leader's choice; the worker adopts it
FLAG_TORCH_GATES = 1 << 2  # gates through torch.distributed (NCCL / gloo), not the data connection
PROTOCOL = struct.pack("<I", MAGIC)  # the auth proofs' protocol name: b"T4SD", as it travels
FLAG_EXACT = 1 << 3  # --numerics exact (else ds4's): both ranks must compute alike
KNOWN_FLAGS = FLAG_AUTH | FLAG_DEBUG_HASH | FLAG_TORCH_GATES | FLAG_EXACT
N_RANK = 2  # the only rank count this version serves
GATES_PER_LAYER = 2
DEFAULT_GATE_TIMEOUT_MS = 750

# Sanity bounds on any hello, so even a hostile one cannot make a receiver size anything absurd
# (check_peer then requires every dimension to equal this end's model).
MAX_LAYERS = 0xFFFF  # the gate header's u16 layer
MAX_EMBD = 1 << 16
MAX_VOCAB = 1 << 24
MAX_CTX = 1 << 24
MAX_SPLIT_DIM = 1 << 16  # n_expert, n_head
MAX_SLAB_BYTES = 1 << 31  # one bulk gate record's payload

HELLO = struct.Struct("<4IQ9I3I")
FRAME_HEADER = struct.Struct("<3I")
GATE_HEADER = struct.Struct("<IHHQIHH")
F32 = np.dtype("<f4")
U32 = np.dtype("<u4")


class DS4TError(Exception):
    """A protocol violation or a failed exchange; `field` names what was wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class DS4TClosed(DS4TError):
    """The peer closed the connection, or went quiet past the deadline, mid-record."""


class GateTimeout(DS4TClosed):
    """A gate exchange did not finish within the gate timeout."""


class GateDesync(DS4TError):
    """The peer's gate record is for another layer, gate, seq, row count or rank."""


class HelloRefused(DS4TError):
    """The peer's hello does not fit this end; the message names the field and both values."""


class PeerRefused(HelloRefused):
    """The peer sent a refusal record in place of its hello; `reason` is its text."""

    def __init__(self, reason: str):
        super().__init__("refused", reason)
        self.reason = reason


class TlsMismatch(HelloRefused):
    """One end speaks TLS, the other plain text."""
