"""bitcomm.codecs._launch: a launch by key passes what Triton's own launch passes.

The codecs run on CPU tensors with the Triton path forced and a stand-in driver
(:func:`bitcomm.bench.host.stand_in`): launches go through Triton's real argument binding,
specialisation and kernel cache, and its compile step hands out a stand-in kernel that
records what it is launched with. Every launch is made twice,
by ``_launch.launch`` and then by ``kernel[grid]`` itself: the same compiled kernel must get
the same arguments, stream, metadata and hooks. Under the dev extra's Triton and the GPU
image's (the releases of ``_launch.VERIFIED``), in a subprocess each.
"""

import json
import os
import subprocess
import sys

import pytest

_GPU_TRITON = os.path.join(sys.prefix, "triton-gpu")

_SCRIPT = r"""
import json, sys
import torch, triton
from triton.runtime import driver
from triton.knobs import HookChain

from bitcomm.bench.host import stand_in

launched = []  # (compiled kernel, what its run() got)
asked = stand_in(launched).asked  # what launches asked the driver for

from bitcomm.codecs import _frame, _kernels, _launch, counts, qsgd, sign, sparse
from bitcomm.codecs import select
from bitcomm.collectives import _kernels as ring

assert _launch._DIRECT, triton.__version__
_frame.FORCE = "triton"
direct = [0, 0, 0]  # launches by key, launches in all, launches replayed from a plan


def hooked(args):
    # Triton's launch passes its hook chains even with no hook in them, and the launch
    # metadata for them, where a launch by key passes None for an empty chain, and no
    # metadata without a hook: the launcher calls no hook either way
    args = list(args)
    for at in (7, 8):  # the enter and exit hooks
        if isinstance(args[at], HookChain) and not args[at].calls:
            args[at] = None
    if args[7] is None and args[8] is None:
        args[6] = None
    return args


def same(a, b):
    a, b = hooked(a), hooked(b)
    return len(a) == len(b) and all(x is y or (type(x) is type(y) and x == y
                                               and not isinstance(x, torch.Tensor))
                                    for x, y in zip(a, b))


def checked(kernel, grid, *args, **kwargs):
    key = _launch._key(kernel, 0, args, kwargs)
    by_key = key is not None and key in _launch._KERNELS
    plan = getattr(_launch._LOCAL, "plan", None)
    at = plan.at if plan is not None and plan.replay else None
    launched.clear()
    _launch.launch(kernel, grid, *args, **kwargs)
    direct[2] += at is not None and plan.replay and plan.at == at + 1
    (got,) = launched
    launched.clear()
    kernel[grid](*args, **kwargs)
    (want,) = launched
    name = kernel.fn.__name__
    assert got[0] is want[0], ("another compiled kernel", name, key)
    assert same(got[1], want[1]), ("other arguments", name, got[1], want[1])
    direct[0] += by_key
    direct[1] += 1


_kernels.launch = checked
g = torch.Generator().manual_seed(5)
for n in (1, 9, 16, 17, 1000, 4097, 70000, 2**18 + 5):  # the last: a top-k's sampled bound
    x = torch.randn(n + 3, generator=g)
    for v in (x[:n], x[1 : n + 1], x[3:].double(), x[:n].bfloat16()):  # 16-byte aligned or not
        for _ in range(2):  # the second time by key
            sign.pack(v)
            qsgd.encode(v, 4, seed=1)
            if v.dtype == torch.float32:
                qsgd.encode(v, 2, bucket=1000, seed=1)
                _kernels.top_indices(v.abs(), max(1, n // 100))
                _kernels.top_indices(v, max(1, n // 3), 1)
                chosen = select.select_abs(v, max(1, n // 10), check=False)
                sparse.encode_at(v, chosen, check=False)
                sparse.encode_top(v, max(1, n // 100), check=False)  # written by the selection
    c = torch.randint(0, 4, (n,), generator=g, dtype=torch.uint8)
    _frame.FORCE = "numpy"
    frames = [counts.pack(c, 3), qsgd.encode(x[:n], 4, seed=2), sign.pack(x[:n]),
              sparse.encode_at(x[:n], torch.arange(0, n, 3))]
    _frame.FORCE = "triton"
    for _ in range(2):
        sparse.decode(frames[3], n=n)
        planes = ring.count_step(None, x[:n], 0, 1)  # a ring's first step, then a middle one
        ring.count_step(planes, x[1 : n + 1], 1, 2, tie_base=3)
        counts.pack(c, 3)
        counts.unpack(frames[0], n, 3)
        qsgd.decode(frames[1], n=n)
        qsgd.decode(frames[1])
        sign.unpack(frames[2], n)
        sign.unpack(frames[2][0:], n, dtype=torch.float64)
# a constexpr of another type but an equal value (True == 1 as a dict key) is passed as given
bits = torch.empty(2, dtype=torch.uint8)
for widen in (False, 0, False, 0):
    checked(_kernels._sign_pack_kernel, (1,), x[:9], bits, 9, 2, BLOCK=1024, WIDEN=widen)
# ints of every width Triton types (int32, int64, uint64), specialised or not (the header
# words); the stand-in kernels never run, so sizes past the vector's are only arguments
frame = torch.empty(16, dtype=torch.uint8)
for _ in range(2):
    for big in (5, 2**31 - 16, 2**31, 2**31 + 1, 2**32 + 16, 2**63 - 1, -2**40, 2**63, 2**64 - 16):
        checked(_kernels._sign_pack_kernel, (1,), x[:9], bits, big, 2, BLOCK=1024, WIDEN=False)
        checked(_kernels._head_kernel, (1,), frame, big, 7, HEAD=16, num_warps=1)
# a plan replays what its first run recorded; a launch with other keywords than recorded
# (a setting its key missed) goes by key, and the plan is dropped, to be recorded anew
for block, replayed, kept in ((1024, 0, True), (1024, 1, True), (512, 0, False),
                              (512, 0, True), (512, 1, True)):
    before = direct[2]
    with _launch.planned(("test",)):
        checked(_kernels._sign_pack_kernel, (1,), x[:9], bits, 9, 2, BLOCK=block, WIDEN=False)
    assert (direct[2] - before, ("test",) in _launch._PLANS) == (replayed, kept), block
# a replay asks the driver for the device and the stream once, at its start; on
# another device than recorded it ends there (the plan dropped), and the next call records
# the plan anew for that device
_kernels.launch = _launch.launch
v = torch.randn(2**18, generator=g)
for device, replays, recorded in ((0, False, 0), (0, True, 0), (1, False, None),
                                  (1, False, 1), (1, True, 1)):
    driver.active.device = device
    asked.clear()
    launched.clear()
    _kernels.top_indices(v, 2621)  # 9 launches from a sampled bound
    # (a call recorded whole on device 0 asks for the device before it leaves the rest to
    # the launches' plan on device 1)
    assert (asked.count("stream") == 1 and asked.count("device") <= 2) == replays, (device,
                                                                                    asked)
    assert len(launched) == 9, (device, launched)
    plans = [_launch._PLANS[k][0] for k in _launch._PLANS
             if k[0] is _kernels.top_indices and k[1] == 2**18]
    assert plans == ([] if recorded is None else [recorded]), (device, plans)
driver.active.device = 0
# a setting that picks another compiled kernel (COUNT_STAGES: the count pass's loads in
# flight) is in the key of a call recorded whole: set, the next call launches that kernel,
# not the recorded one; set back, the first again
count_pass = {}
for stages in (1, 1, 2, 2, 1):
    _kernels.COUNT_STAGES = stages
    launched.clear()
    _kernels.top_indices(v, 2621)
    count_pass.setdefault(stages, set()).add(launched[1][0])  # after sample_bound's launch
_kernels.COUNT_STAGES = 1
assert len(count_pass[1]) == len(count_pass[2]) == 1 and count_pass[1] != count_pass[2]

# with a hook in a chain, a launch by key passes the chains and the metadata as Triton does
_kernels.launch = checked
hook = lambda metadata: None  # noqa: E731
for chain in (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook):
    chain.add(hook)
    before = direct[0]
    checked(_kernels._sign_pack_kernel, (1,), x[:9], bits, 9, 2, BLOCK=1024, WIDEN=False)
    assert direct[0] == before + 1  # by key
    chain.remove(hook)

# A top-k from a sampled bound is recorded whole, then made again without its Python: the
# launcher gets the values, and pointers at the same places in the inputs and allocations,
# that launches by key pass for the same inputs, and the result lies where theirs does.
empty, allocated = torch.empty, []


def logged(*args, **kwargs):
    t = empty(*args, **kwargs)
    allocated.append(t)
    return t


def place(pointer, sources):
    # (the first source holding the address, its byte offset there)
    hits = [(i, pointer - s.data_ptr()) for i, s in enumerate(sources)
            if s.data_ptr() <= pointer <= s.data_ptr() + s.numel() * s.element_size()]
    assert hits, pointer
    return hits[0]


wrapped = []  # launches through _kernels.launch (a whole replay makes none)


def counted(kernel, grid, *args, **kwargs):
    wrapped.append(kernel)
    _launch.launch(kernel, grid, *args, **kwargs)


def same_launches(runs, by_key, ours, theirs, name):
    # the replay's launches are of the kernels the launches by key take, and pass what they
    # pass, each pointer an int at the place in `ours` where their tensor lies in `theirs`
    assert [kernel for kernel, _ in runs] == [kernel for kernel, _ in by_key], name
    for (_, r), (_, w) in zip(runs, by_key):
        assert r[:6] == w[:6] and r[6:9] == (None, None, None) and len(r) == len(w), name
        for a, b in zip(r[9:], w[9:]):  # where a launch by key passes a tensor, an int
            if isinstance(b, torch.Tensor):
                assert type(a) is int, (name, a)
                assert place(a, ours) == place(b.data_ptr(), theirs), name
            else:
                assert type(a) is type(b) and a == b, (name, a, b)


def made(call):
    # its result, launches (compiled kernel, arguments), allocations and launches through
    # _kernels.launch
    allocated.clear()
    launched.clear()
    wrapped.clear()
    got = call()
    return got, list(launched), list(allocated), len(wrapped)


torch.empty = logged
_kernels.launch = counted
n, k = 2**18, 2621
header = sparse.HEADER.pack(n, k, 0)
header_mean = sparse.HEADER.pack(n, k, 3)
cases = {
    "indices": lambda v, f: _kernels.top_indices(v, k),
    "census": lambda v, f: _kernels.top_indices(v, k, 1, census=True),
    "frame": lambda v, f: _kernels.top_frame(v, k, header, "fp32", f[: 17 + 8 * k]),
    "mean": lambda v, f: _kernels.top_frame(v, k, header_mean, "mean", f[: 21 + 4 * k],
                                           side=1, census=True),
}
for name, call in cases.items():
    def inputs():
        v = torch.randn(n, generator=g)
        return v, empty(32 + 8 * k, dtype=torch.uint8)[15:]
    v, f = inputs()
    call(v, f)  # recorded
    before = len(_launch._CALLS)
    v, f = inputs()
    got, runs, mine, through = made(lambda: call(v, f))
    assert len(runs) == (10 if name == "mean" else 9) and through == 0, (name, through)
    _launch.PLANS = False
    want, by_key, theirs, through = made(lambda: call(v, f))
    _launch.PLANS = True
    assert through == len(runs), name
    assert len(mine) == len(theirs) and len(_launch._CALLS) == before, (name, mine, theirs)
    frame = f[: 17 + 8 * k] if name == "frame" else f[: 21 + 4 * k]
    sources = lambda owned: (v, frame, *owned)  # noqa: E731
    same_launches(runs, by_key, sources(mine), sources(theirs), name)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    kinds = lambda ts: [None if t is None else (t.dtype, t.shape) for t in ts]  # noqa: E731
    assert kinds(got) == kinds(want), name
    for h, w in zip(got, want):
        if w is not None:
            assert (place(h.data_ptr(), sources(mine))
                    == place(w.data_ptr(), sources(theirs))), name
# qsgd's encoder is recorded whole with its stream key as a scalar: a replay of another key
# passes that key where the launch by key does, and the rest as it does; its frame lies in
# its allocation where theirs does
flag = torch.zeros(1, dtype=torch.int32)
qsgd_call = lambda v, key: _kernels.qsgd_frame(v, 4, 512, key, b"q" * 14, flag)  # noqa: E731
qsgd_call(torch.randn(4096, generator=g), 5)  # recorded
v = torch.randn(4096, generator=g)
got, runs, mine, through = made(lambda: qsgd_call(v, 2**32 - 16))
_launch.PLANS = False
want, by_key, theirs, through_by_key = made(lambda: qsgd_call(v, 2**32 - 16))
_launch.PLANS = True
assert len(runs) == 1 and len(mine) == len(theirs) == 1 and (through, through_by_key) == (0, 1)
same_launches(runs, by_key, (v, flag, *mine), (v, flag, *theirs), "qsgd")
assert -16 in runs[0][1]  # the key as the kernel takes it (a signed int32)
size = qsgd.encoded_size(4096, 4, 512)
assert got.numel() == want.numel() == size
assert place(got.data_ptr(), (v, flag, *mine)) == place(want.data_ptr(), (v, flag, *theirs))
# an allocation aligned otherwise than recorded (no allocator of torch's makes one) leaves
# the call to its own path, whose frame's codes start aligned again
start = size - 4096 // 2


def shifted(size, *, dtype, device=None):
    size = size[0] if isinstance(size, tuple) else size
    return empty(size + 1, dtype=dtype, device=device)[1:]


torch.empty = shifted
got, runs, mine, through = made(lambda: qsgd_call(v, 7))
torch.empty = logged
assert through == 1 and (got.data_ptr() + start) % 16 == 0, (through, got.data_ptr() % 16)
# qsgd's decoder is recorded whole, with the header it compares and without, and for a
# bfloat16 result (its kernel takes the values as int16), each its own kernels: its full
# tiles and its edge tile are two launches; the values it returns are its allocation
n = 50001
for dtype, header in ((torch.float32, None), (torch.float32, b"h" * 14),
                      (torch.bfloat16, None), (torch.bfloat16, b"h" * 14)):
    size = qsgd.encoded_size(n, 4, 512)
    decode_call = lambda f: _kernels.qsgd_decode(  # noqa: E731
        f, 14, n, 4, 512, dtype, flag, header)
    decode_call(empty(size, dtype=torch.uint8))  # recorded
    f = empty(size, dtype=torch.uint8)
    got, runs, mine, through = made(lambda: decode_call(f))
    _launch.PLANS = False
    want, by_key, theirs, through_by_key = made(lambda: decode_call(f))
    _launch.PLANS = True
    assert len(runs) == 2 and through == 0 and through_by_key == 2, (dtype, runs)
    assert len(mine) == len(theirs) == 1, dtype
    same_launches(runs, by_key, (f, flag, *mine), (f, flag, *theirs), dtype)
    assert got is mine[0] and want is theirs[0], dtype
torch.empty = empty
# not whole: a path with torch's own kernels (the two-digit path zeroes its work buffer);
# a call whose launch takes a tensor from outside its inputs and allocations; one given a
# scalar the kernel specialises (sign pack's n: its value could pick another kernel), or
# a scalar no launch takes (a replay would keep the recorded value)
for _ in range(2):
    _kernels.top_indices(torch.randn(70000, generator=g), 700)
assert not [key for key in _launch._CALLS if key[:2] == (_kernels.top_indices, 70000)]
outside = torch.empty(2, dtype=torch.uint8)
for zero, far, scalars, whole in ((True, False, (), False), (False, True, (), False),
                                  (False, False, ("n",), False), (False, False, ("nope",), False),
                                  (False, False, (), True)):
    _launch._CALLS.pop(("whole",), None)
    _launch._PLANS.pop(("whole",), None)
    with _launch.planned(("whole",), (x,), scalars) as plan:
        out = torch.empty(2, dtype=torch.uint8)
        if zero:
            out.zero_()
        _launch.launch(_kernels._sign_pack_kernel, (1,), x[:9], outside if far else out, 9, 2,
                       BLOCK=1024, WIDEN=False)
        plan.returns(out)
    assert (("whole",) in _launch._CALLS) == whole, (zero, far, scalars)
# a replay with a hook set, or on another device, is left to the caller
launched.clear()
assert _launch.replay(("whole",), (x,)) is not _launch.MISSED and len(launched) == 1
triton.knobs.runtime.launch_enter_hook.add(hook)
assert _launch.replay(("whole",), (x,)) is _launch.MISSED
triton.knobs.runtime.launch_enter_hook.remove(hook)
driver.active.device = 1
assert _launch.replay(("whole",), (x,)) is _launch.MISSED
driver.active.device = 0
print(json.dumps({"triton": triton.__version__, "direct": direct[0], "launches": direct[1],
                  "replayed": direct[2]}))
"""


@pytest.mark.parametrize("triton_dir", [None, _GPU_TRITON], ids=["dev-triton", "gpu-triton"])
def test_a_launch_by_key_passes_what_tritons_own_launch_passes(triton_dir):
    if triton_dir is not None and not os.path.isdir(triton_dir):
        pytest.skip(f"{triton_dir} is missing: `make test` installs the GPU image's triton")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if triton_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [triton_dir, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["triton"].startswith(("3.6." if triton_dir else "3.9."))
    # most launches are repeats: the comparison covered the path by key, not only Triton's,
    # and the top-k's second calls replayed their plans (9 to 11 launches a call)
    assert report["direct"] > report["launches"] // 3, report
    assert report["replayed"] >= 50, report


@pytest.mark.parametrize(("variable", "name"), [("BITCOMM_DIRECT_LAUNCH", "_DIRECT"),
                                               ("BITCOMM_PLANS", "PLANS")])
@pytest.mark.parametrize(("value", "on"), [(None, True), ("0", False), ("1", True)])
def test_a_switch_set_to_0_turns_its_path_off(variable, name, value, on):
    """BITCOMM_DIRECT_LAUNCH=0 turns the launch by key off (a compiled, verified Triton), every
    launch then Triton's own; BITCOMM_PLANS=0 turns the replays of planned and replay off, the
    launch by key kept."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop(variable, None)
    if value is not None:
        env[variable] = value
    code = f"from bitcomm.codecs import _launch; print(_launch.{name}, _launch._DIRECT)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(on), str(on or name == "PLANS")]


def test_bench_host_times_each_call_with_and_without_the_replays(tmp_path):
    """`bitcomm bench host` (a process of its own: it installs the stand-in driver) prints and
    saves a row per codec operation, each with its time under the replays, its anchor without
    them and their ratio, the Markdown table headed by date, machine and command; where the
    launches go through Triton's own path, or triton is missing, it says why and stops."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "bitcomm.cli", "bench", "host", "--sizes", "300K",
               "--calls", "2", "--rounds", "1", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "host.json").read_text())["rows"]
    assert [(r["codec"], r["op"]) for r in rows] == [
        ("sign", "encode"), ("sign", "decode"), ("qsgd-4", "encode"), ("qsgd-4", "decode"),
        ("topk-1%", "encode"), ("redsync-1%", "select")]
    for r in rows:
        assert r["n"] == 300 << 10 and r["host_us"] > 0 and r["anchor_us"] > 0, r
        assert abs(r["ratio"] - r["host_us"] / r["anchor_us"]) < 1e-9, r
        assert f"{r['codec']:<12} {r['op']:<7}" in result.stdout
    table = (tmp_path / "host.md").read_text()
    assert "- Command: `bitcomm bench host --sizes 300K --calls 2 --rounds 1 --seed 0`" in table
    assert "- Triton: 3.9." in table and "- Date: " in table
    assert table.count("\n| ") == 1 + 1 + len(rows)  # header, rule, rows
    env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2 and "Triton's own path" in result.stderr, result.stderr
    # without triton at all, it says what to install
    blocked = ["-c", "import sys; sys.modules['triton'] = None; from bitcomm.cli import main; "
               "main()"] + command[3:]
    result = subprocess.run([sys.executable, *blocked], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 2 and "triton is not installed" in result.stderr, result.stderr


_ONE_COMPILE = r"""
import json
import torch
from triton.runtime.jit import JITFunction

from bitcomm.bench.host import stand_in

stand_in()
compiles = []
stub = JITFunction._do_compile


def counted(self, *args, **kwargs):
    compiles.append(self.fn.__name__)
    return stub(self, *args, **kwargs)


JITFunction._do_compile = counted
from bitcomm.codecs import _frame, _kernels

_frame.FORCE = "triton"
x = torch.randn(4096)
scales = torch.empty(8)
for key in (5, 1, 16, 17, 2**31 + 16, 2**32 - 1):  # 1, multiples of 16, and others
    _kernels.qsgd_codes(x, 4, 512, key, scales, None)
print(json.dumps(compiles))
"""


def test_the_qsgd_stream_key_is_data_one_compiled_kernel_for_every_key():
    """The encoder's stream key is data, as a header word is: a key of 1 or a multiple of 16
    (one draw in sixteen from a generator) takes the compiled kernel of any other key, where
    a specialised argument would compile a variant of its own, a stall of seconds in a
    training step on a GPU."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", _ONE_COMPILE], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == ["_qsgd_codes_kernel"]
