"""The worker of a tensor-parallel pair (rank 1): `TPWorker.open(...).serve()`.

It binds rank 1's share of the model, dials the leader, and runs every command the leader
mirrors to it on its own sessions, meeting the leader at every gate; after each command it
reports (layer hashes with --debug-hash,) its vocabulary part of the logits and an ack. It
returns when the leader sends STOP or closes the control connection, and raises TPError when
the pair fails (a gate timeout, a desync, a dead leader): the pair cannot continue after a
half-run step, so the caller exits or joins again (`ds4 tp-worker --rejoin`).
"""

from __future__ import annotations

import logging

import numpy as np

from ..engine import Engine, Session
from ..wire import ds4t
from .link import Options, Pair, TPError, join_leader
from .rank import open_rank

log = logging.getLogger("ds4.tp")

WORKER_RANK = 1


class TPWorker:
    def __init__(self, engine: Engine, pair: Pair):
        self.engine = engine
        self.pair = pair
        self.sessions: dict[int, Session] = {}
        self.commands = 0

    @classmethod
    def open(cls, path, leader: tuple[str, int], backend: str = "reference", numerics: str = "ds4",
             opts: Options | None = None, connect_timeout: float = 10.0, engine: Engine | None = None,
             **backend_options) -> "TPWorker":
        """Bind rank 1's share (or reuse `engine`, one a previous pair bound) and join."""
        opts = opts or Options()
        if engine is None:
            engine = open_rank(path, WORKER_RANK, backend, numerics, **backend_options)
        pair = join_leader(*leader, engine.model, opts, connect_timeout, engine.backend.name,
                           engine.numerics)
        engine.partner = pair.partner
        return cls(engine, pair)

    def serve(self) -> None:
        """Run the leader's commands until STOP or the leader closes; TPError when the pair fails."""
        ch = self.pair.control
        try:
            while True:
                try:
                    frame = ch.recv(idle_timeout=None)
                except ds4t.DS4TClosed as e:
                    if e.field == "eof":
                        log.info("tensor parallel: the leader closed the connection")
                        return
                    raise
                if isinstance(frame, ds4t.Stop):
                    log.info("tensor parallel: the leader sent STOP")
                    return
                self._run(frame)
        except ds4t.DS4TError as e:
            raise TPError(f"tensor parallel failed after {self.commands} commands: {e}") from None
        finally:
            self.pair.close()
            self.engine.partner = None

    def _run(self, frame) -> None:
        sid = frame.session
        status = ds4t.AckStatus.OK
        s = self.sessions.get(sid)
        logits_before = None if s is None else s._logits
        try:
            if isinstance(frame, ds4t.SessionCreate):
                self.sessions[sid] = self.engine.session(ctx=frame.ctx, prefill_cap=frame.prefill_cap)
            elif s is None:
                log.warning("tensor parallel: %s for unknown session %d", frame.TYPE.name, sid)
                status = ds4t.AckStatus.UNAVAILABLE
            elif isinstance(frame, ds4t.SessionDestroy):
                del self.sessions[sid]
            elif isinstance(frame, ds4t.Sync):
                s.sync(frame.tokens.tolist())
            elif isinstance(frame, ds4t.Eval):
                want = self.pair.partner.seq + 1
                if frame.seq != want:
                    raise ds4t.GateDesync("seq", f"EVAL for gate seq {frame.seq}, this worker is at {want}")
                s.eval(frame.token)
            elif isinstance(frame, ds4t.Rewind):
                s.rewind(frame.pos)
            elif isinstance(frame, ds4t.Invalidate):
                s.sync([])
            elif isinstance(frame, ds4t.State):
                s.load_payload(frame.payload)
        except ds4t.DS4TError:
            raise  # the pair is broken: no ack can help
        except Exception as e:  # the command failed here; the leader hears FAILED
            log.error("tensor parallel: %s of session %d failed: %s", frame.TYPE.name, sid, e)
            status = ds4t.AckStatus.FAILED
        self.commands += 1
        ch = self.pair.control
        for h in self.pair.partner.take_hashes():
            ch.send(ds4t.Hash(h.seq, h.value))
        s = self.sessions.get(sid)
        ran = (status == ds4t.AckStatus.OK and s is not None and s._logits is not None
               and s._logits is not logits_before and not isinstance(frame, ds4t.State))
        if ran:
            first = self.engine.part.vocab.start
            ch.send(ds4t.Logits(first, np.asarray(s._logits, dtype=np.float32)))
        ch.send(ds4t.CommandAck(sid, status))
