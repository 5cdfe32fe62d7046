"""Properties every frame decoder shares: bounded allocation and an optional expected length."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from bitcomm import codecs
from bitcomm.codecs import _frame, bits, counts, qsgd, redsync, sign, sparse

# A tiny frame whose header claims 2**28 elements (1 GiB as float32), for each decoder whose
# output is not backed by payload bytes, and a qsgd frame whose bucket field asks for as much.
HOSTILE = {
    # what qsgd.encode(torch.ones(5), 4, 2**28) writes: one bucket, scale 1, five codes 0111
    "qsgd-bucket": "qsgd.decode(torch.tensor(list(struct.pack('<qBBIf', 5, 4, 0, 2**28, 1.0) "
                   "+ bytes([0x77, 0x77, 0x70])), dtype=torch.uint8))",
    "counts-m0": "counts.decode(torch.tensor(list(struct.pack('<qHB', 2**28, 0, 0)), "
                 "dtype=torch.uint8))",
    "sparse-n": "sparse.decode(torch.tensor(list(struct.pack('<qqB', 2**28, 0, 0)), "
                "dtype=torch.uint8))",
    "redsync-n": "redsync.decode(torch.tensor(list(struct.pack('<qqBf', 2**28, 0, 3, 0.0)), "
                 "dtype=torch.uint8))",
}

_PROBE = """
import json, resource, struct, sys
import torch
from bitcomm.codecs import counts, qsgd, redsync, sparse
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = peak()
try:
    out, used = {call}
    result = ["ok", out.numel(), used]
except Exception as e:
    result = [type(e).__name__, str(e)]
print(json.dumps({{"grew": peak() - base, "result": result}}))
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_tiny_frame_cannot_make_a_decoder_allocate_much(case):
    # In a fresh process, so the peak resident size measures this decode alone.
    probe = subprocess.run([sys.executable, "-c", _PROBE.format(call=HOSTILE[case])],
                           capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    assert got["grew"] < 64 << 20, (case, got)
    if case == "qsgd-bucket":  # a legal frame: 5 values, however large the bucket
        assert got["result"] == ["ok", 5, 21]
        assert qsgd.encode(torch.ones(5), 4, 2**28, seed=1).tolist() == list(
            struct.pack("<qBBIf", 5, 4, 0, 2**28, 1.0) + bytes([0x77, 0x77, 0x70]))
    else:  # the claimed length is refused, naming the field and how to accept it
        assert got["result"][0] == "ValueError" and "n=268435456" in got["result"][1], got
        assert "pass n=" in got["result"][1], got


def test_the_limit_scales_with_the_frame():
    # 2**16 elements from any frame, else 4096 per frame byte: a 17-byte empty sparse frame may
    # stand for 69632 elements, not one more, unless the caller says it expects more.
    assert codecs.MIN_DECODE_LIMIT == 1 << 16 and codecs.MAX_ELEMENTS_PER_BYTE == 4096
    ok = sparse.encode(torch.tensor([], dtype=torch.int64), torch.tensor([]), 17 * 4096)
    dense, used = sparse.decode(ok)
    assert dense.numel() == 17 * 4096 and used == 17
    big = sparse.encode(torch.tensor([], dtype=torch.int64), torch.tensor([]), 17 * 4096 + 1)
    with pytest.raises(ValueError, match=r"n=69633 .* 17-byte"):
        sparse.decode(big)
    dense, _ = sparse.decode(big, n=17 * 4096 + 1)
    assert dense.numel() == 17 * 4096 + 1 and not dense.any()
    # an out tensor states the length too: a very sparse frame adds into it
    one = sparse.encode(torch.tensor([5]), torch.tensor([2.0]), 1 << 20)
    out = torch.ones(1 << 20)
    assert sparse.decode(one, out=out)[0] is out and out[5] == 3.0 and out.sum() == (1 << 20) + 2
    # a frame's own payload always justifies its length: 1-bit signs are 8 elements a byte
    n = 1 << 20
    assert sign.decode(sign.encode(torch.ones(n)))[0].numel() == n
    # counts with m = 0 carry no payload: 11 bytes stand for at most 2**16 counts
    assert counts.decode(counts.encode(torch.zeros(1 << 16, dtype=torch.int32), 0))[0].numel() \
        == 1 << 16
    with pytest.raises(ValueError, match="n=65537"):
        counts.decode(counts.encode(torch.zeros((1 << 16) + 1, dtype=torch.int32), 0))


FRAMES = {
    "sign": (lambda: sign.encode(torch.randn(50)), sign.decode),
    "sign-scaled": (lambda: sign.encode_scaled(torch.randn(50)), sign.decode_scaled),
    "bits": (lambda: bits.encode(torch.arange(50) % 8, 3), bits.decode),
    "counts": (lambda: counts.encode(torch.arange(50) % 3, 2, "radix"), counts.decode),
    "qsgd": (lambda: qsgd.encode(torch.randn(50), 4, 16, seed=1), qsgd.decode),
    "sparse": (lambda: sparse.encode(torch.tensor([3, 9]), torch.tensor([1.0, 2.0]), 50),
               sparse.decode),
    "sparse-entries": (lambda: sparse.encode(torch.tensor([3]), torch.tensor([1.0]), 50),
                       lambda f, **kw: sparse.decode_entries(f, **kw)[::3]),
    "redsync": (lambda: redsync.encode(torch.randn(50), 5), redsync.decode),
}


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_an_expected_length_is_checked_against_the_header(name):
    make, decode = FRAMES[name]
    frame = make()
    out, used = decode(frame, n=50)
    assert used == frame.numel() and (name == "sparse-entries" or out.numel() == 50)
    with pytest.raises(ValueError, match="expected n=49, got n=50"):
        decode(frame, n=49)
    with pytest.raises(TypeError, match="n"):
        decode(frame, n=50.0)


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_a_frame_is_taken_as_bytes_or_a_numpy_array_and_must_be_one_row(name):
    """Every decoder reads bytes, bytearray, memoryview and a uint8 numpy array as it reads
    the tensor of the same bytes; any other dtype is a TypeError, and a frame of two or more
    dimensions a ValueError, whether a tensor or an array."""
    make, decode = FRAMES[name]
    frame = make()
    want, used = decode(frame)
    raw = frame.numpy()
    for form in (bytes(raw), bytearray(raw), memoryview(raw), raw, np.repeat(raw, 2)[::2]):
        got, at = decode(form)
        assert at == used and torch.equal(got, want), type(form)
    with pytest.raises(TypeError, match="uint8"):
        decode(raw.astype(np.int16))
    for rows in (frame.reshape(1, -1), raw.reshape(1, -1)):
        with pytest.raises(ValueError, match="expected frame to be 1-D, got shape"):
            decode(rows)


@pytest.mark.parametrize("name", sorted(FRAMES))
@pytest.mark.parametrize("n", [-1, -(2**63)])
def test_a_negative_length_in_the_header_is_refused(name, n):
    """Every frame starts with its length as an int64: a negative one is a ValueError that
    names the field, with or without an expected length."""
    make, decode = FRAMES[name]
    frame = make().clone()
    frame[:8] = torch.tensor(list(struct.pack("<q", n)), dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"expected n >= 0, got {n}"):
        decode(frame)
    with pytest.raises(ValueError):
        decode(frame, n=50)


def test_the_collectives_decode_with_the_length_they_expect(monkeypatch):
    from bitcomm.collectives import qsgd_allgather, sparse_allgather
    from bitcomm.comm import run_local

    seen = []
    for module, name in ((qsgd, "decode"), (sparse, "decode")):
        real = getattr(module, name)

        def spy(frame, *args, _real=real, **kw):
            seen.append(kw.get("n", kw["out"].numel() if kw.get("out") is not None else None))
            return _real(frame, *args, **kw)
        monkeypatch.setattr(module, name, spy)
    x = torch.randn(40)
    run_local(lambda c: qsgd_allgather(c, x, seed=1), 2)
    run_local(lambda c: sparse_allgather(c, x, 4), 2)
    assert seen and all(n == 40 for n in seen), seen



def _reencoders():
    """Per decoder: (seed frames, decode, re-encode of an accepted frame or None if lossy)."""
    g = torch.Generator().manual_seed(3)

    def counts_again(out, frame):
        _, m, code = counts.HEADER.unpack(bytes(frame[: counts.HEADER.size].tolist()))
        return counts.encode(out.to(torch.int64), m, counts.PACKINGS[code])

    def sparse_again(entries, frame):
        idx, val, n, _ = entries
        fmt = sparse.FORMATS[int(frame[16])]
        return None if fmt == "qsgd" else sparse.encode(idx, val, n, fmt)

    sizes = (0, 1, 9, 33, 70)
    return {
        "sign": ([sign.encode(torch.randn(n, generator=g)) for n in sizes], sign.decode,
                 lambda out, frame: sign.encode(out)),
        "sign-scaled": ([sign.encode_scaled(torch.randn(n, generator=g)) for n in sizes],
                        sign.decode_scaled, None),
        "bits": ([bits.encode(torch.randint(0, 1 << w, (n,), generator=g), w)
                  for n in sizes for w in (1, 5, 16)], bits.decode,
                 lambda out, frame: bits.encode(out, int(frame[8]))),
        "counts": ([counts.encode(torch.randint(0, m + 1, (n,), generator=g), m, p)
                    for n in sizes for m in (0, 2, 7) for p in counts.PACKINGS], counts.decode,
                   counts_again),
        "qsgd": ([qsgd.encode(torch.randn(n, generator=g), b, bucket, seed=1)
                  for n in sizes for b in qsgd.BITS for bucket in (1, 8, 1000)], qsgd.decode,
                 None),
        "sparse": ([sparse.encode(torch.randperm(n, generator=g)[: n // 3],
                                  torch.randn(n // 3, generator=g), n, f)
                    for n in sizes for f in sparse.FORMATS],
                   lambda f: sparse.decode_entries(f), sparse_again),
        "sparse-dense": ([sparse.encode(torch.tensor([1, 4]), torch.tensor([2.0, -1.0]), 9)],
                         sparse.decode, None),
    }


_HOSTILE_INTS = (0, 1, -1, 7, 2**16 + 1, 2**31, 2**40, 2**62, 2**63 - 1)


def _mutate(rng, frame: bytes) -> bytes:
    kind = rng.randrange(6)
    b = bytearray(frame)
    if kind == 0 and b:  # flip a few bytes
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] ^= rng.randint(1, 255)
    elif kind == 1:  # truncate
        del b[rng.randrange(len(b) + 1):]
    elif kind == 2:  # trailing bytes, which the decoder must leave alone
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == 3 and len(b) >= 16:  # a hostile int64 header field
        at = rng.choice((0, 8))
        b[at:at + 8] = struct.pack("<q", rng.choice(_HOSTILE_INTS))
    elif kind == 4 and len(b) >= 14:  # a hostile small field: qsgd's bucket, counts' m, ...
        at = rng.randrange(8, len(b) - 3)
        b[at:at + 4] = struct.pack("<I", rng.choice((0, 1, 2**16 - 1, 2**31, 2**32 - 1)))
    else:  # noise
        b = bytearray(rng.randrange(256) for _ in range(rng.randrange(40)))
    return bytes(b)


def fuzz(seed: int, rounds: int) -> dict:
    """Mutate every decoder's valid frames ``rounds`` times each; return what went wrong."""
    import random

    rng = random.Random(seed)
    stats = {"decoded": 0, "refused": 0, "problems": []}
    for name, (frames, decode, again) in _reencoders().items():
        for i in range(rounds):
            data = _mutate(rng, bytes(frames[i % len(frames)].tolist()))
            buf = torch.tensor(list(data), dtype=torch.uint8)
            try:
                got = decode(buf)
            except (ValueError, TypeError, OverflowError):
                stats["refused"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - what the test is looking for
                stats["problems"].append([name, data.hex(), f"{type(e).__name__}: {e}"])
                continue
            stats["decoded"] += 1
            out, used = (got[0], got[-1])
            limit = max(codecs.MIN_DECODE_LIMIT, codecs.MAX_ELEMENTS_PER_BYTE * len(data))
            if not 0 < used <= len(data) or out.numel() > limit:
                stats["problems"].append([name, data.hex(), f"used {used}, {out.numel()} out"])
            elif again is not None:
                same = again(got if name == "sparse" else out, buf[:used])
                if same is not None and same.tolist() != list(data[:used]):
                    stats["problems"].append([name, data.hex(), "re-encodes differently"])
    return stats


@pytest.mark.timeout(200)
def test_fuzzed_frames_are_refused_cleanly_or_decoded_exactly():
    # In a fresh process, so its peak resident size bounds every decode's allocations.
    code = ("import json, resource, sys; sys.path.insert(0, 'tests'); import test_decoders; "
            "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024; "
            "base = peak(); stats = test_decoders.fuzz(seed=20261123, rounds=300); "
            "stats['grew'] = peak() - base; print(json.dumps(stats))")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=180, check=True)
    stats = json.loads(probe.stdout.strip().splitlines()[-1])
    assert stats["problems"] == [], stats["problems"][:5]
    assert stats["grew"] < 128 << 20, stats["grew"]
    # the mutations reach both outcomes in numbers: neither side is an untested corner
    assert stats["decoded"] > 200 and stats["refused"] > 1000, stats


def test_deferred_checks_read_once_and_raise_the_first_broken_rule():
    from bitcomm.codecs import _frame

    from conftest import forced, host_reads

    good = sign.pack(torch.randn(13))
    bad_pad = good.clone()
    bad_pad[-1] |= 1  # 13 signs: the last 3 bits are padding
    over = counts.pack(torch.tensor([3, 0, 1]), 3)  # a 3 where m=2 allows at most 2
    fine = counts.pack(torch.tensor([2, 0, 1]), 2)
    with forced("torch"):
        def ok():
            with _frame.deferred():
                for _ in range(3):
                    sign.unpack(good, 13)
                    counts.unpack(fine, 3, 2)

        assert len(host_reads(ok)) == 1  # six decodes, one read at the end
        with pytest.raises(ValueError, match="decoded count 3 > m=2"):
            with _frame.deferred():
                sign.unpack(good, 13)
                counts.unpack(over, 3, 2)  # flagged first
                sign.unpack(bad_pad, 13)  # flagged too
        with pytest.raises(ValueError, match="padding bits must be zero"):
            sign.unpack(bad_pad, 13)  # outside a block: at once
        q = qsgd.encode(torch.randn(13), 4, 8, seed=0)  # 13 * 4 bits: 4 padding bits
        q[-1] |= 1
        with pytest.raises(ValueError, match="codes padding bits"):
            with _frame.deferred():  # an inner block's precise check raises in an outer one
                with _frame.deferred():
                    qsgd.decode_all([q], 13, 4, 8)
        with pytest.raises(KeyError):  # an error inside the block is not masked by the checks
            with _frame.deferred():
                counts.unpack(over, 3, 2)
                raise KeyError("boom")


def test_collect_takes_only_an_outermost_handover_blocks_flags():
    """Inside _frame.collect a handover block's flags go unread to the collector, for the
    caller's own read; a block without handover, or one inside another block, reads at its
    end as ever."""
    from bitcomm.codecs import _frame

    from conftest import forced

    q = qsgd.encode(torch.randn(13), 4, 8, seed=0)  # 13 * 4 bits: 4 padding bits
    q[-1] |= 1
    with forced("torch"):
        checks = []
        with _frame.collect(checks):
            with _frame.deferred(handover=True):
                qsgd.decode_all([q], 13, 4, 8)  # flagged, not raised
        assert len(checks) == 1
        with pytest.raises(ValueError, match="codes padding bits"):
            _frame.read_checked(checks)
        for outer, inner in ((False, True), (True, False)):
            kept = []
            with pytest.raises(ValueError, match="codes padding bits"):
                with _frame.collect(kept):
                    with _frame.deferred(handover=outer):
                        with _frame.deferred(handover=inner):
                            qsgd.decode_all([q], 13, 4, 8)
            assert kept == []
        with _frame.deferred(handover=True):  # no collector: read at the end
            with pytest.raises(ValueError, match="codes padding bits"):
                with _frame.deferred(handover=True):
                    qsgd.decode_all([q], 13, 4, 8)


def test_a_deferred_qsgd_frame_is_decoded_quietly_then_refused():
    """On the numpy path a frame with broken rules is decoded (without numpy's warnings) and
    refused at the end of the block: both rules, each alone."""
    import warnings

    from bitcomm.codecs import _frame

    frame = qsgd.encode(torch.randn(13), 4, 8, seed=0)  # 13 * 4 bits: 4 padding bits
    padded = frame.clone()
    padded[-1] |= 1
    scaled = frame.clone()
    scaled[qsgd.HEADER.size:qsgd.HEADER.size + 4] = torch.tensor(
        list(struct.pack("<f", float("inf"))), dtype=torch.uint8)
    for bad, message in [(padded, "codes padding bits"), (scaled, "finite scale >= 0")]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=message):
                with _frame.deferred():
                    values, _ = qsgd.decode(bad)
                    assert values.numel() == 13


def test_frames_back_to_back_are_read_as_rows_without_a_copy(path):
    """rows_of views equal-sized frames that lie back to back in one buffer (an allgather's
    receive buffer) as the rows of a 2-D tensor, and stacks a copy otherwise: frames out of
    order, of another buffer, with a gap. The collectives' batched decodes give the same
    values either way."""
    from bitcomm.codecs import _frame

    recv = torch.arange(60, dtype=torch.uint8)
    parts = list(recv.split(20))
    rows = _frame.rows_of(parts)
    assert rows.shape == (3, 20) and rows.data_ptr() == recv.data_ptr()
    assert torch.equal(rows, recv.view(3, 20))
    for other in ([parts[1], parts[0], parts[2]], [parts[0], parts[1].clone(), parts[2]],
                  [recv[0:20], recv[21:41]]):
        got = _frame.rows_of(other)
        assert got.data_ptr() != recv.data_ptr() and torch.equal(got, torch.stack(other))
    g = torch.Generator().manual_seed(3)
    frames = [qsgd.encode(torch.randn(1001, generator=g), 4, 100, seed=r) for r in range(3)]
    joined = torch.cat(frames).split(frames[0].numel())
    for a, b in zip(qsgd.decode_all(list(joined), 1001, 4, 100),
                    qsgd.decode_all(frames, 1001, 4, 100), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(qsgd.mean_all(list(joined), 1001, 4, 100)[0],
                       qsgd.mean_all(frames, 1001, 4, 100)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_large_cpu_outputs_are_numpys_arrays_where_numpy_has_the_dtype(dtype):
    """The sign and sparse decoders' outputs on the CPU's numpy path are arrays numpy
    allocated (numpy asks Linux for huge pages, which made these decodes 2.5-4.5x faster at
    64M elements), with the values the torch path gives; bfloat16, which numpy lacks, and the
    torch path allocate through torch."""
    from conftest import forced

    x = torch.randn(1003)
    idx = torch.tensor([0, 7, 1002])
    frames = {"sign": sign.pack(x), "sparse": sparse.encode(idx, x[idx], 1003)}

    def decoded():
        return {"sign": sign.unpack(frames["sign"], 1003, dtype=dtype),
                "sparse": sparse.decode(frames["sparse"], dtype=dtype)[0]}

    with forced("torch"):
        want = decoded()
    got = decoded()
    for name in frames:
        assert got[name].dtype == dtype and torch.equal(got[name], want[name]), name
        # numpy owns a from_numpy tensor's memory, which torch cannot resize
        numpys = not got[name].untyped_storage().resizable()
        assert numpys == (dtype != torch.bfloat16), name
        assert want[name].untyped_storage().resizable(), name
    assert torch.equal(got["sign"], torch.where(x >= 0, 1.0, -1.0).to(dtype))
    for shape in (0, (0,), (3, 0)):  # empty: torch's, whose strides let it be viewed as bytes
        empty = _frame.host_array(shape, dtype, x)
        assert empty.untyped_storage().resizable() and empty.view(torch.uint8).numel() == 0
    assert torch.equal(got["sparse"][idx], x[idx].to(dtype)) and got["sparse"].count_nonzero() == 3
