"""Fuzzing GGUF files that load: every mutated file either runs a forward step or is refused with a
one-line RaymoeError (issue 14). Mutations are seeded, so a failing case reproduces by its name."""
import faulthandler
import os
import random
import signal
import struct
import sys
import traceback

import pytest

from raymoe.tools.make_tiny import make_tiny
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.errors import RaymoeError
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams

BASES = (("qwen35moe", "f32"), ("gptoss", "f32"), ("qwen35moe", "q8_0"))
CASES_PER_BASE = 110
CASE_SECONDS = 30      # a case takes well under a second; the margin is for a loaded CI machine
HUGE = (2**62, 2**63, 2**64 - 1, 2**32, 2**31 - 1)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def header_fields(data: bytes):
    """(category, offset, size) of every header field of a well-formed GGUF, and where tensor data starts.
    Categories with 8-byte fields that are counts, lengths, dims or offsets end in '64'."""
    fields = [("magic", 0, 4), ("version", 4, 4), ("count64", 8, 8), ("count64", 16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(cat):
        nonlocal pos
        n, = struct.unpack_from("<Q", data, pos)
        fields.append((cat + "_len64", pos, 8))
        if n:
            fields.append((cat, pos + 8, n))
        pos += 8 + n

    for _ in range(n_kv):
        string("key")
        vtype, = struct.unpack_from("<I", data, pos)
        fields.append(("vtype", pos, 4))
        pos += 4
        if vtype == 8:
            string("value_str")
        elif vtype == 9:
            item, count = struct.unpack_from("<IQ", data, pos)
            fields += [("array_type", pos, 4), ("array_count64", pos + 4, 8)]
            pos += 12
            start = pos
            for i in range(count):
                if item == 8:
                    if i < 3:
                        string("array_str")
                    else:
                        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
                else:
                    pos += _SCALAR_SIZES[item]
            fields.append(("array_items", start, pos - start))
        else:
            fields.append(("value", pos, _SCALAR_SIZES[vtype]))
            pos += _SCALAR_SIZES[vtype]
    for _ in range(n_tensors):
        string("tensor_name")
        n_dims, = struct.unpack_from("<I", data, pos)
        fields.append(("n_dims", pos, 4))
        fields += [("dim64", pos + 4 + 8 * i, 8) for i in range(n_dims)]
        pos += 4 + 8 * n_dims
        fields += [("tensor_type", pos, 4), ("tensor_offset64", pos + 4, 8)]
        pos += 12
    return fields, -(-pos // 32) * 32


def mutate(data: bytes, fields, data_start: int, rng: random.Random) -> tuple[str, bytes]:
    """One seeded mutation: (description, new file bytes)."""
    kind = rng.choice(("flip", "flip", "bytes", "huge", "value", "truncate", "data", "data"))
    if kind == "truncate":
        cut = rng.randrange(data_start + 64) if rng.random() < 0.7 else rng.randrange(data_start, len(data))
        return f"truncate at {cut}", data[:cut]
    out = bytearray(data)
    if kind == "data":       # garbage weights, often NaN/inf: the forward pass must bear them
        at = rng.randrange(data_start, len(data) - 64)
        n = rng.choice((4, 64, 4096))
        fill = rng.choice((b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff", None))
        out[at:at + n] = (fill * (n // 4) if fill else rng.randbytes(n))[:len(out) - at]
        return f"data {'random' if fill is None else fill.hex()} x{n} at {at}", bytes(out)
    if kind == "value":      # a config value at an extreme: zero, all ones, NaN, huge, negative
        _, off, size = rng.choice([f for f in fields if f[0] == "value" or f[0] == "array_items" and f[2] <= 64])
        fill = rng.choice((b"\x00", b"\xff", b"\x7f", b"\x80", b"\x01"))
        n = size if size <= 8 else 4          # a scalar, or one element of a small array
        at = off + rng.randrange(0, size - n + 1, n)
        out[at:at + n] = fill * n
        return f"value {fill.hex()} at {at}", bytes(out)
    categories = sorted({c for c, _, _ in fields if kind != "huge" or c.endswith("64")})
    cat = rng.choice(categories)
    _, off, size = rng.choice([f for f in fields if f[0] == cat])
    if kind == "flip":
        bit = rng.randrange(8 * size)
        out[off + bit // 8] ^= 1 << bit % 8
        return f"flip bit {bit} of {cat} at {off}", bytes(out)
    if kind == "bytes":
        n = min(size, rng.choice((1, 2, 4, 8)))
        at = off + rng.randrange(size - n + 1)
        out[at:at + n] = rng.randbytes(n)
        return f"random {n} bytes in {cat} at {at}", bytes(out)
    value = rng.choice(HUGE)
    struct.pack_into("<Q", out, off, value)
    return f"{cat} at {off} = {value}", bytes(out)


def run_case(path: str):
    """Open, load every layer and run two steps of a short prompt; 'refused' or 'ran'."""
    try:
        model = open_model(path)
        engine = LocalEngine(model, mode="auto")
        seq = engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, temperature=0))
        engine.run_until_done()
    except RaymoeError as e:
        assert "\n" not in str(e), f"multi-line error: {e!r}"
        return "refused"
    assert seq.error is None, seq.error      # a sequence that failed inside the engine hides an exception
    return "ran"


class CaseTimeout(Exception):
    pass


def _timeout(signum, frame):
    raise CaseTimeout(f"over {CASE_SECONDS} s")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    out = []
    for arch, gguf_type in BASES:
        d = tmp_path_factory.mktemp(f"fuzz-{arch}-{gguf_type}")
        out.append((f"{arch}-{gguf_type}", open(make_tiny(arch, str(d), gguf_type=gguf_type), "rb").read()))
    return out


def test_mutated_gguf_runs_or_is_refused(bases, tmp_path):
    failures, outcomes = [], {"ran": 0, "refused": 0}
    old = signal.signal(signal.SIGALRM, _timeout)
    try:
        for name, data in bases:
            fields, data_start = header_fields(data)
            assert run_case(_write(tmp_path, data)) == "ran", f"{name}: the unmutated file must run"
            for i in range(CASES_PER_BASE):
                what, mutated = mutate(data, fields, data_start, random.Random(f"{name}/{i}"))
                path = _write(tmp_path, mutated)
                # a hang in native code never sees the alarm: dump every thread and exit rather than stall CI
                faulthandler.dump_traceback_later(2 * CASE_SECONDS, exit=True)
                signal.alarm(CASE_SECONDS)
                try:
                    outcomes[run_case(path)] += 1
                except BaseException as e:           # noqa: B036 - every escape is a finding, even a timeout
                    failures.append(f"{name}/{i} ({what}): {''.join(traceback.format_exception_only(e)).strip()}")
                    print(failures[-1], "\n", "".join(traceback.format_tb(e.__traceback__)[-3:]), file=sys.stderr)
                finally:
                    signal.alarm(0)
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)
    assert not failures, f"{len(failures)} of {len(bases) * CASES_PER_BASE} cases failed:\n" + "\n".join(failures)
    assert sum(outcomes.values()) >= 300
    assert outcomes["ran"] >= 60, outcomes        # enough mutations reach weight loading and the forward pass


def _write(tmp_path, data: bytes) -> str:
    path = os.path.join(tmp_path, "case.gguf")
    with open(path, "wb") as f:
        f.write(data)
    return path
