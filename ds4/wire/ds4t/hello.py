"""The DS4T hello: the 72-byte record both ends send first on each connection (`Hello`, with
`Role` and `Backend`), its internal checks, `check_peer`'s rules for accepting a peer's hello
and agreeing on ctx, and `vocab_part`, the vocabulary split the hello's n_rank implies.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .base import (FLAG_AUTH, FLAG_DEBUG_HASH, FLAG_EXACT, FLAG_TORCH_GATES, GATES_PER_LAYER, HELLO,
                   KNOWN_FLAGS, MAGIC, MAX_CTX, MAX_EMBD, MAX_LAYERS, MAX_SPLIT_DIM, MAX_VOCAB,
                   N_RANK, VERSION, DS4TError, HelloRefused)


class Role(IntEnum):
    LEADER = 0
    WORKER = 1


class Backend(IntEnum):
    REFERENCE = 0
    MLX = 1
    TRITON = 2

    @classmethod
    def named(cls, name: str) -> "Backend":
        return cls[name.upper()]


@dataclass(frozen=True)
class Hello:
    role: Role
    flags: int
    fingerprint: int  # first 8 bytes of the model fingerprint, little-endian
    n_layer: int
    n_embd: int
    n_vocab: int
    n_expert: int
    n_head: int
    ctx: int
    gates_per_token: int
    n_rank: int
    rank: int
    version: int = VERSION
    backend: int = Backend.REFERENCE

    @classmethod
    def for_gguf(cls, model, role: Role, ctx: int, *, auth: bool = False,
                 debug_hash: bool = False, torch_gates: bool = False,
                 backend: str = "reference", exact: bool = False) -> "Hello":
        """The hello for a loaded `ds4.core.gguf_model.GGUFModel` (its config and fingerprint)."""
        c = model.config
        return cls.for_model(role, fingerprint=model.fingerprint64, n_layer=c.n_layer,
                             n_embd=c.n_embd, n_vocab=c.n_vocab, n_expert=c.n_expert,
                             n_head=c.n_head, ctx=ctx, auth=auth, debug_hash=debug_hash,
                             torch_gates=torch_gates, backend=backend, exact=exact)

    @classmethod
    def for_model(cls, role: Role, *, fingerprint: int, n_layer: int, n_embd: int, n_vocab: int,
                  n_expert: int, n_head: int, ctx: int, auth: bool = False,
                  debug_hash: bool = False, torch_gates: bool = False,
                  backend: str = "reference", exact: bool = False) -> "Hello":
        """The hello of a two-rank pair member (rank = role)."""
        flags = ((FLAG_AUTH if auth else 0) | (FLAG_DEBUG_HASH if debug_hash else 0)
                 | (FLAG_TORCH_GATES if torch_gates else 0) | (FLAG_EXACT if exact else 0))
        return cls(Role(role), flags, fingerprint, n_layer, n_embd, n_vocab,
                   n_expert, n_head, ctx, GATES_PER_LAYER * n_layer, N_RANK, int(role),
                   backend=Backend.named(backend))

    def pack(self) -> bytes:
        return HELLO.pack(MAGIC, self.version, self.role, self.flags, self.fingerprint,
                          self.n_layer, self.n_embd, self.n_vocab, self.n_expert, self.n_head,
                          self.ctx, self.gates_per_token, self.n_rank, self.rank, self.backend, 0, 0)

    @classmethod
    def unpack(cls, buf: bytes) -> "Hello":
        if len(buf) != HELLO.size:
            raise DS4TError("hello", f"expected {HELLO.size} bytes, got {len(buf)}")
        (magic, version, role, flags, fp, n_layer, n_embd, n_vocab, n_expert, n_head, ctx,
         gpt, n_rank, rank, backend, *reserved) = HELLO.unpack(buf)
        if magic != MAGIC:
            raise DS4TError("magic", f"expected {MAGIC:#010x} (DS4T hello), got {magic:#010x}")
        if version != VERSION:
            raise DS4TError("version", f"expected {VERSION}, got {version}")
        if role not in tuple(Role):
            raise DS4TError("role", f"expected 0 (leader) or 1 (worker), got {role}")
        if flags & ~KNOWN_FLAGS:
            raise DS4TError("flags", f"unknown bits {flags & ~KNOWN_FLAGS:#x}")
        if any(reserved):
            raise DS4TError("reserved", f"expected zero, got {reserved}")
        if backend not in tuple(Backend):
            raise DS4TError("backend", f"expected one of {[int(b) for b in Backend]}, got {backend}")
        hello = cls(Role(role), flags, fp, n_layer, n_embd, n_vocab, n_expert, n_head, ctx, gpt,
                    n_rank, rank, version, Backend(backend))
        hello.check()
        return hello

    def check(self) -> None:
        """Internal consistency; raises DS4TError naming the first bad field."""
        for name, top in (("n_layer", MAX_LAYERS), ("n_embd", MAX_EMBD), ("n_vocab", MAX_VOCAB),
                          ("n_expert", MAX_SPLIT_DIM), ("n_head", MAX_SPLIT_DIM), ("ctx", MAX_CTX)):
            v = getattr(self, name)
            if not 1 <= v <= top:
                raise DS4TError(name, f"expected 1..{top}, got {v}")
        if self.gates_per_token != GATES_PER_LAYER * self.n_layer:
            raise DS4TError("gates_per_token", f"expected {GATES_PER_LAYER} × n_layer = "
                            f"{GATES_PER_LAYER * self.n_layer}, got {self.gates_per_token}")
        if self.n_rank != N_RANK:
            raise DS4TError("n_rank", f"expected {N_RANK} (this version), got {self.n_rank}")
        if self.rank != self.role:
            raise DS4TError("rank", f"expected {int(self.role)} for the {self.role.name.lower()}, "
                            f"got {self.rank}")
        for name in ("n_expert", "n_head"):
            if getattr(self, name) % self.n_rank:
                raise DS4TError(name, f"expected a multiple of n_rank={self.n_rank}, "
                                f"got {getattr(self, name)}")


_MUST_MATCH = ("version", "flags", "fingerprint", "n_layer", "n_embd", "n_vocab", "n_expert",
               "n_head", "gates_per_token", "n_rank")


def check_peer(mine: Hello, theirs: Hello) -> int:
    """The rules for a peer's hello; returns the ctx both run with (the leader's).

    HelloRefused names the field and both sides' values."""
    def show(name: str, v: int) -> str:
        return f"{v:016x}" if name == "fingerprint" else str(v)

    for name in _MUST_MATCH:
        a, b = getattr(mine, name), getattr(theirs, name)
        if name == "flags":  # (DEBUG_HASH is the leader's alone)
            a, b = a & ~FLAG_DEBUG_HASH, b & ~FLAG_DEBUG_HASH
        if a != b:
            why = ""
            if name == "flags":
                why = (" (one end has a shared secret, the other not)" if (a ^ b) & FLAG_AUTH else
                       " (one end computes --numerics exact, the other ds4)" if (a ^ b) & FLAG_EXACT else
                       " (one end exchanges gates through torch.distributed, the other over TCP)")
            raise HelloRefused(name, f"this {mine.role.name.lower()} has {show(name, a)}, the peer "
                               f"{theirs.role.name.lower()} has {show(name, b)}{why}")
    if mine.role == theirs.role:
        raise HelloRefused("role", f"both ends are {mine.role.name.lower()}s; roles must differ")
    if mine.rank == theirs.rank:
        raise HelloRefused("rank", f"both ends are rank {mine.rank}; ranks must differ")
    return mine.ctx if mine.role == Role.LEADER else theirs.ctx


def vocab_part(n_vocab: int, n_rank: int, rank: int) -> tuple[int, int]:
    """(first, count) of the vocabulary rows rank `rank` computes in the output head."""
    first = rank * n_vocab // n_rank
    return first, (rank + 1) * n_vocab // n_rank - first
