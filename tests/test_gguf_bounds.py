"""GGUF limits before reading (ds4/core/gguf_model.py): headers written byte by byte from the GGUF
spec whose counts and lengths exceed the file are refused naming the key, before anything is
read or allocated; a truncated file names the tensor; expert ids of a hash layer outside
[0, n_expert) are refused at load; hypothesis: metadata written by gguf-py's GGUFWriter reads back
equal, and any mutation of a model's header is refused with ModelError (or still opens)."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4.core.gguf_model import GGUFModel, ModelError, _Reader
from ds4.core.tiny import make_tiny, preset_config

ROOT = Path(__file__).resolve().parents[1]
HUGE = 1 << 63
U32, STRING, ARRAY = int(GGUFValueType.UINT32), int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)


# ---- headers by hand (GGUF v3: magic, u32 version, u64 tensor_count, u64 kv_count, KVs, infos) --

def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv(key: bytes, vtype: int, value: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + value


def gguf(kvs: list[bytes], infos: list[bytes] = (), n_kv=None, n_tensors=None) -> bytes:
    return (b"GGUF" + struct.pack("<IQQ", 3, len(infos) if n_tensors is None else n_tensors,
                                  len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos))


GOOD_KV = kv(b"general.architecture", STRING, gstr(b"deepseek4"))
CASES = {
    "string array count": (gguf([GOOD_KV, kv(b"tokenizer.ggml.tokens", ARRAY,
                                             struct.pack("<IQ", STRING, HUGE) + gstr(b"a"))]),
                           "tokenizer.ggml.tokens"),
    "string length": (gguf([GOOD_KV, kv(b"general.name", STRING, struct.pack("<Q", HUGE) + b"x")]),
                      "general.name"),
    "key length": (gguf([struct.pack("<Q", HUGE) + b"general"]), "metadata entry 0"),
    "kv_count": (gguf([GOOD_KV], n_kv=HUGE), "GGUF.kv_count"),
    "tensor_count": (gguf([GOOD_KV], n_tensors=HUGE), "GGUF.tensor_count"),
    "n_dims": (gguf([GOOD_KV], [gstr(b"t") + struct.pack("<I", 1 << 31) + b"\0" * 64]), "n_dims"),
    "array of arrays count": (gguf([kv(b"x.nested", ARRAY, struct.pack("<IQ", ARRAY, HUGE))]),
                              "x.nested"),
    "value type": (gguf([kv(b"x.odd", 99, b"\0" * 8)]), "x.odd"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_counts_and_lengths_beyond_the_file_are_refused_naming_the_field(name, tmp_path):
    data, field = CASES[name]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelError) as e:
        GGUFModel(path)
    assert field in str(e.value) and str(path) in str(e.value)


def test_inspect_refuses_a_2_63_array_count_at_once(tmp_path):
    """The issue's case, in a subprocess with a memory cap: before the fix it looped and grew."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf([GOOD_KV, kv(b"deepseek4.compress_ratios", ARRAY,
                                       struct.pack("<IQ", U32, HUGE) + b"\0" * 16)]))

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    code = "import sys; from cli.main import main; sys.argv = ['ds4', 'inspect', sys.argv[1]]; main()"
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, preexec_fn=cap,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"})
    assert r.returncode == 1, r.stderr
    assert "deepseek4.compress_ratios" in r.stderr and "Traceback" not in r.stderr


# ---- a real (tiny) model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("m") / "test.gguf", preset="test", seed=1)


def test_a_truncated_file_names_the_tensor(model_path, tmp_path):
    ref = GGUFReader(model_path)  # gguf-py's own reader locates the last tensor
    last = max(ref.tensors, key=lambda t: t.data_offset)
    data = model_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: last.data_offset + 1])
    with pytest.raises(ModelError, match="truncated") as e:
        GGUFModel(cut)
    assert last.name in str(e.value)


def test_a_tensor_off_the_alignment_names_the_tensor(model_path, tmp_path):
    """A tensor whose offset is not on general.alignment (GGUF places each one there) is refused
    naming it; before, its bytes were read one off and generation found no finite logit."""
    ref = GGUFReader(model_path)  # gguf-py's reader gives the tensor's dims
    t = next(t for t in ref.tensors if t.name == "output_norm.weight")
    name = t.name.encode()
    data = bytearray(model_path.read_bytes())
    at = data.find(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 8 * len(t.shape) + 4
    (offset,) = struct.unpack_from("<Q", data, at)
    struct.pack_into("<Q", data, at, offset + 1)
    path = tmp_path / "unaligned.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=f"output_norm.weight: its data offset {offset + 1} is not a "
                                         f"multiple of the file's alignment {ref.alignment}"):
        GGUFModel(path)


def _tensor_info_at(data: bytes, t) -> int:
    """Where tensor t's info (its name's length) starts in the file."""
    name = t.name.encode()
    return data.find(struct.pack("<Q", len(name)) + name)


@pytest.mark.parametrize("mutation, message", [
    ("name", "its name is not UTF-8"),
    ("zero dim", "expected no zero dimension"),
    ("cut in merges", "metadata key 'tokenizer.ggml.merges': string"),
])
def test_header_damage_names_the_key_or_tensor(model_path, tmp_path, mutation, message):
    """A tensor name that is not UTF-8, a zero dimension, a file cut inside a string array: each
    is a ModelError naming the tensor or the key, not a codec or numpy error."""
    ref = GGUFReader(model_path)
    t = next(t for t in ref.tensors if t.name == "output_norm.weight")
    data = bytearray(model_path.read_bytes())
    at = _tensor_info_at(data, t)
    if mutation == "name":
        data[at + 8] = 0xFF
    elif mutation == "zero dim":
        struct.pack_into("<Q", data, at + 8 + len(t.name) + 4, 0)
    else:
        merges = ref.fields["tokenizer.ggml.merges"]  # (cut a few bytes before the array's end)
        data = data[: merges.offset + sum(int(p.nbytes) for p in merges.parts) - 10]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=re.escape(message)) as e:
        GGUFModel(path)
    if mutation == "zero dim":
        assert "output_norm.weight" in str(e.value)


@pytest.mark.parametrize("bad", [8, 1 << 20, -1])  # n_expert (8) and above, negative
def test_expert_ids_outside_the_range_are_refused(model_path, tmp_path, bad):
    cfg = preset_config("test")
    ref = GGUFReader(model_path)
    t = next(t for t in ref.tensors if t.name == "blk.1.ffn_gate_tid2eid.weight")
    assert int(t.tensor_type) == 26  # I32
    data = bytearray(model_path.read_bytes())
    token, slot = 77, 1
    at = t.data_offset + 4 * (token * cfg.n_expert_used + slot)  # row-major [vocab][k]
    data[at: at + 4] = struct.pack("<i", bad)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError) as e:
        GGUFModel(path)
    msg = str(e.value)
    assert "blk.1.ffn_gate_tid2eid.weight" in msg and f"[0, {cfg.n_expert})" in msg
    assert f"token {token}" in msg and str(bad) in msg


# ---- hypothesis ---------------------------------------------------------------------------------

HYP = settings(max_examples=60, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

keys = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1, max_size=24)
values = st.one_of(
    st.integers(0, 2**32 - 1).map(lambda v: (GGUFValueType.UINT32, v)),
    st.integers(-2**63, 2**63 - 1).map(lambda v: (GGUFValueType.INT64, v)),
    st.floats(allow_nan=False, width=32).map(lambda v: (GGUFValueType.FLOAT32, v)),
    st.booleans().map(lambda v: (GGUFValueType.BOOL, v)),
    st.text(max_size=40).map(lambda v: (GGUFValueType.STRING, v)),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20).map(lambda v: (GGUFValueType.ARRAY, v)),
    st.lists(st.text(max_size=10), min_size=1, max_size=12).map(lambda v: (GGUFValueType.ARRAY, v)),
)


@HYP
@given(meta=st.dictionaries(keys, values, max_size=12))
def test_metadata_written_by_gguf_py_reads_back_equal(meta, tmp_path_factory):
    path = tmp_path_factory.mktemp("h") / "m.gguf"
    w = GGUFWriter(path, "deepseek4")
    for k, (vtype, v) in meta.items():
        w.add_key_value(f"x.{k}", v, vtype,
                        sub_type=(GGUFValueType.STRING if vtype == GGUFValueType.ARRAY and v
                                  and isinstance(v[0], str) else
                                  GGUFValueType.UINT32 if vtype == GGUFValueType.ARRAY else None))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = _Reader(path)
    for k, (vtype, v) in meta.items():
        f = r.fields[f"x.{k}"]
        got = f.contents()
        if vtype == GGUFValueType.ARRAY and v and isinstance(v[0], str):
            count = int(f.parts[-2][0])  # kept as one span: walk it by hand
            span, offs, got = bytes(f.parts[-1]), 0, []
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", span, offs)
                got.append(span[offs + 8: offs + 8 + n].decode("utf-8"))
                offs += 8 + n
        if vtype == GGUFValueType.FLOAT32:
            assert got == float(np.float32(v))
        else:
            assert got == v, (k, got, v)


def count_positions(path) -> dict[str, list[int]]:
    """Byte offsets of every u64 count and length in a GGUF's header by kind, located with
    gguf-py's own reader: the two header counts, key lengths, string lengths, array counts,
    tensor name lengths and tensor dims."""
    r = GGUFReader(path)
    pos: dict[str, list[int]] = {"header": [8, 16], "key": [], "string": [], "array": [],
                                 "tensor name": [], "dim": []}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        klen = 8 + len(name.encode("utf-8"))
        pos["key"].append(f.offset)
        if f.types[0] == GGUFValueType.STRING:
            pos["string"].append(f.offset + klen + 4)
        elif f.types[0] == GGUFValueType.ARRAY:
            pos["array"].append(f.offset + klen + 4 + 4)
    for t in r.tensors:
        pos["tensor name"].append(t.field.offset)
        dims_at = t.field.offset + 8 + len(t.name.encode("utf-8")) + 4
        pos["dim"] += [dims_at + 8 * k for k in range(len(t.shape))]
    return pos


class Overtime(BaseException):
    """Not an Exception, so that no `except Exception` in the code under test turns it into a
    clean-looking error."""


@contextlib.contextmanager
def within(seconds: float):
    """Fail (instead of hanging) when the block runs longer than `seconds`."""
    def over(signum, frame):
        raise Overtime(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, over)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def model_bytes(model_path) -> tuple[bytes, int, list[int]]:
    return model_path.read_bytes(), GGUFReader(model_path).data_offset, count_positions(model_path)


@HYP
@given(data=st.data())
def test_a_mutated_header_is_refused_with_model_error(model_bytes, tmp_path_factory, data):
    raw, header_end, counts = model_bytes
    buf = bytearray(raw)
    kind = data.draw(st.sampled_from(["bytes", "count", "truncate"]))
    if kind == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 3))):
            if kind == "count":  # a count or length that claims more than the file holds
                at = data.draw(st.sampled_from(counts[data.draw(st.sampled_from(sorted(counts)))]))
                (was,) = struct.unpack_from("<Q", buf, at)
                buf[at: at + 8] = struct.pack("<Q", data.draw(st.sampled_from(
                    [HUGE, 2**64 - 1, 2**32, len(raw), len(raw) // 4, was + 1])))
            else:
                buf[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("mut") / "m.gguf"
    path.write_bytes(bytes(buf))
    with within(3.0):
        try:
            GGUFModel(path)
        except ModelError:
            pass
