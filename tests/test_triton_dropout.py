"""hpcmeg/kernels/dropout.py: the Philox keep-mask twin (CPU), its known-answer vectors, the
Triton kernel against the twin bit for bit in Triton's CPU interpreter, the custom op (opcheck),
and the op inside torch.compile (Inductor, CPU) with gradients.

The same kernel is compiled for sm90 here but not run (no GPU on this machine).
Tolerances: none but bit for bit (tests/TOLERANCES.md, case 1): the masks are integers, and the
dropout output is the same two multiplies of the same values on both sides.
"""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from hpcmeg.kernels import dropout as td


def _seed(v: int) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.int64)


def test_philox_known_answer_vectors():
    """Random123's published KAT for philox4x32_10 (tests/kat_vectors of
    github.com/DEShawResearch/random123): counter words 0-3, key words 0-1 -> output words 0-3.
    Independent of Triton's code, so the twin is pinned to the standard generator."""
    kat = [
        ("00000000 00000000 00000000 00000000", "00000000 00000000", "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
        ("ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff", "408f276d 41c83b0e a20bc7c6 6d5451fd"),
        ("243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0", "d16cfe09 94fdcceb 5001e420 24126ea1"),
    ]
    for ctr, key, want in kat:
        words = [torch.tensor([int(w, 16)], dtype=torch.int64) for w in (ctr + " " + key).split()]
        got = " ".join(f"{int(w):08x}" for w in td.philox4x32_10(*words))
        assert got == want, (ctr, key)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_twin_keep_fraction_and_determinism(p):
    n = 200_003  # not a multiple of 8 (a partial last counter) nor of 8 * BLOCK (a partial last program)
    a = td.reference_keep_mask(_seed(1234), [n], p)
    assert a.dtype == torch.bool and a.shape == (n,)
    # binomial: the keep fraction has std sqrt(p (1 - p) / n) (6.7e-4 at p = 0.1, 1.1e-3 at 0.5); 5 std
    tol = 5 * math.sqrt(p * (1 - p) / n)
    assert abs(a.float().mean().item() - (1 - p)) < tol
    # ...and so does each 16-bit half of each Philox output word (element e takes half e % 8 of
    # counter e // 8); tol * sqrt(8) is the 5-std bound of an eighth of the sample
    groups = a[: n // 8 * 8].view(-1, 8)
    for g in range(8):
        assert abs(groups[:, g].float().mean().item() - (1 - p)) < tol * math.sqrt(8), g
    # the two halves of one word are independent: they agree on a fraction p^2 + (1 - p)^2
    lo, hi = groups[:, 0::2].reshape(-1), groups[:, 1::2].reshape(-1)
    assert abs((lo == hi).float().mean().item() - (p * p + (1 - p) ** 2)) < 2 * tol
    assert torch.equal(td.reference_keep_mask(_seed(1234), [n], p), a)  # pure function of the seed
    b = td.reference_keep_mask(_seed(1235), [n], p)
    # independent masks disagree on a fraction 2 p (1 - p) of the elements
    assert abs((a != b).float().mean().item() - 2 * p * (1 - p)) < 2 * tol
    # element i depends on (seed, i) only: a shorter mask is a prefix, a reshaped one the same bits
    assert torch.equal(td.reference_keep_mask(_seed(1234), [5000], p), a[:5000])
    assert torch.equal(td.reference_keep_mask(_seed(1234), [8, 25_000], p), a[:200_000].view(8, 25_000))


def test_thresholds_and_scale():
    """p is applied in steps of 2**-16 and the kept values' factor makes the expectation exact."""
    assert td.threshold(0.0) == 0 and td.threshold(1.0) == 65536
    assert td.threshold(0.1) == 6554 and td.threshold(0.5) == 32768
    for p in (0.0, 0.01, 0.1, 0.25, 0.3, 0.5, 0.9, 0.99999):
        t = td.threshold(p)
        assert abs(t / 65536 - p) <= 2**-17  # p_eff within half a step of p
        assert abs((1 - t / 65536) * td.keep_scale(p) - 1) < 1e-15
    assert td.keep_scale(0.25) == 1 / 0.75 and td.keep_scale(1.0) == 0.0
    # a p between two steps rounds: the draw h in [0, 65535] is kept iff h >= t
    s = _seed(7)
    words = td.philox4x32_10(*[torch.zeros(1, dtype=torch.int64)] * 4, s & 0xFFFFFFFF, s >> 32)
    h0 = int(words[0]) & 0xFFFF  # element 0 is the low half of counter 0's first word
    for t in (h0, h0 + 1):
        p = t / 65536
        assert bool(td.reference_keep_mask(s, [1], p)[0]) == (h0 >= t)


def test_layout():
    """Element e is half e % 8 of counter e // 8 (independent of the kernel's BLOCK)."""
    s = _seed(99)
    z = torch.zeros(1, dtype=torch.int64)
    words = td.philox4x32_10(torch.tensor([5]), z, z, z, s & 0xFFFFFFFF, s >> 32)  # counter 5
    halves = [int(w) >> sh & 0xFFFF for w in words for sh in (0, 16)]
    t = td.threshold(0.3)
    assert td.reference_keep_mask(s, [64], 0.3)[40:48].tolist() == [h >= t for h in halves]


def test_twin_edge_cases():
    s = _seed(2**62 - 1)  # high key word non-zero
    assert bool(td.reference_keep_mask(s, [3, 8193], 0.0).all())  # h >= 0 always: p = 0 keeps all
    assert not bool(td.reference_keep_mask(s, [3, 8193], 1.0).any())  # h < 65536 always
    e = td.reference_keep_mask(s, [0, 7], 0.1)
    assert e.shape == (0, 7) and e.dtype == torch.bool
    assert td.reference_keep_mask(s, [], 0.5).shape == ()
    with pytest.raises(ValueError):
        td.reference_keep_mask(s, [4], 1.5)
    with pytest.raises(ValueError):
        td.reference_keep_mask(s.to(torch.int32), [4], 0.1)


def test_custom_op_opcheck_and_fake():
    """torch.library.opcheck (schema, fake/meta, aot dispatch) on CPU inputs: the op's twin path."""
    seed = td.draw_seed("cpu")
    assert seed.dtype == torch.int64 and seed.shape == (1,) and 0 <= int(seed) < 2**62
    for shape, p in (([3, 4100], 0.1), ([0], 0.5), ([7], 0.0)):
        torch.library.opcheck(td.dropout_keep_mask, (seed, shape, p))
        assert torch.equal(td.dropout_keep_mask(seed, shape, p), td.reference_keep_mask(seed, shape, p))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        f = td.dropout_keep_mask(torch.empty(1, dtype=torch.int64), [2, 3], 0.1)
    assert f.shape == (2, 3) and f.dtype == torch.bool


def test_inside_torch_compile_with_grad():
    """draw_seed + the op in one fullgraph Inductor (CPU) graph: runs, reproducible under
    torch.manual_seed, fresh masks otherwise, and d(out)/dx = keep * keep_scale(p)."""
    p = 0.1
    scale = td.keep_scale(p)

    def f(x):
        return x * td.dropout_keep_mask(td.draw_seed(x.device), list(x.shape), p) * scale

    cf = torch.compile(f, backend="inductor", fullgraph=True)
    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).requires_grad_()
    torch.manual_seed(5)
    y1 = cf(x)
    torch.manual_seed(5)
    y2 = cf(x)
    y3 = cf(x)
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, y3)
    keep = y1.detach() != 0  # x ~ N(0, 1) has no zeros
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02  # n = 6000: std 3.9e-3
    # case 1: Inductor's kernel multiplies x by the mask and the scale in the eager expression's order
    # (IEEE-rounded; Inductor's CPU code is compiled with -ffp-contract=off)
    torch.testing.assert_close(y1.detach(), x.detach() * keep * scale, rtol=0, atol=0)
    y1.sum().backward()
    torch.testing.assert_close(x.grad, keep.float() * scale, rtol=0, atol=0)


# Run as a file (not `python -c`): @triton.jit reads the kernel's source with inspect.
_INTERPRETER_CHECK = r"""
import torch
import triton
import triton.language as tl
from hpcmeg.kernels import dropout as td

M = 0xFFFFFFFF

@triton.jit
def _words(seed_ptr, out_ptr, start, BLOCK: tl.constexpr):
    # raw Philox words of counters start + [0, BLOCK), as triton.language.random draws them
    c = start + tl.arange(0, BLOCK).to(tl.int64)
    seed = tl.load(seed_ptr)
    r0, r1, r2, r3 = tl.randint4x(seed, c)
    j = tl.arange(0, BLOCK)
    tl.store(out_ptr + 0 * BLOCK + j, r0.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + 1 * BLOCK + j, r1.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + 2 * BLOCK + j, r2.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + 3 * BLOCK + j, r3.to(tl.int64) & 0xFFFFFFFF)

# 1. raw words, counters across 2**32 (high counter word 0 then 1), a seed > 2**32
B = 64
seed = torch.tensor([0x0123456789ABCDEF], dtype=torch.int64)
start = 2**32 - B // 2
out = torch.empty(4 * B, dtype=torch.int64)
_words[(1,)](seed, out, start, BLOCK=B)
c = torch.arange(start, start + B, dtype=torch.int64)
z = torch.zeros_like(c)
ref = td.philox4x32_10(c & M, c >> 32, z, z, seed & M, (seed >> 32) & M)
for k in range(4):
    assert torch.equal(out[k * B:(k + 1) * B], ref[k]), ("word", k)

# 2. the keep-mask kernel (the launch keep_mask does, minus its CUDA device guard) against the twin
for v in (1234, 2**62 - 1):
    s = torch.tensor([v], dtype=torch.int64)
    for shape in ([7], [3, 8200], [2 * td.PER_CALL * td.BLOCK], [0, 5]):
        for p in (0.0, 0.1, 0.5, 1.0):
            got = torch.empty(shape, dtype=torch.bool)
            n = got.numel()
            if n:
                td._keep_mask_kernel[(triton.cdiv(n, td.PER_CALL * td.BLOCK),)](
                    s, got, n, td.threshold(p), BLOCK=td.BLOCK, num_warps=td.NUM_WARPS)
            assert torch.equal(got, td.reference_keep_mask(s, shape, p)), (v, shape, p)

# 3. the packed kernel (the launch keep_bits does) against the packed twin: a partial last program
for v in (1234, 2**62 - 1):
    s = torch.tensor([v], dtype=torch.int64)
    for shape in ([8], [3, 8200], [2 * td.PER_CALL * td.BLOCK + 64], [0, 16]):
        for p in (0.0, 0.1, 0.5, 1.0):
            got = torch.empty(td.bits_shape(shape), dtype=torch.uint8)
            n = got.numel()
            if n:
                td._keep_bits_kernel[(triton.cdiv(n, td.BLOCK),)](s, got, n, td.threshold(p), BLOCK=td.BLOCK,
                                                                  num_warps=td.NUM_WARPS)
            assert torch.equal(got, td.reference_keep_bits(s, shape, p)), (v, shape, p)
print("ok")
"""


def test_kernel_matches_twin_in_the_interpreter(tmp_path):
    """hpcmeg/kernels/dropout.py's kernel (and triton.language.random's raw Philox words) run by Triton's CPU interpreter against the PyTorch twin, bit for bit."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (slurm/setup-dev.sh installs it for this test)")
    script = tmp_path / "check_triton_dropout.py"
    script.write_text(_INTERPRETER_CHECK)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_packed_bits_twin():
    """pack_bits / unpack_bits are inverse, element 8j + g of a row is bit g of byte j, the packed twin
    is the bool twin packed, and the op (opcheck, fake) gives uint8 [..., H / 8]."""
    s = _seed(4321)
    m = td.reference_keep_mask(s, [3, 5, 64], 0.3)
    b = td.reference_keep_bits(s, [3, 5, 64], 0.3)
    assert b.dtype == torch.uint8 and b.shape == (3, 5, 8)
    assert torch.equal(td.unpack_bits(b, [3, 5, 64]), m) and torch.equal(td.pack_bits(m), b)
    j, g = 5, 3  # row (1, 2): byte 5, bit 3 is element 43
    assert bool((int(b[1, 2, j]) >> g) & 1) == bool(m[1, 2, 8 * j + g])
    assert int(td.pack_bits(torch.tensor([True] + [False] * 6 + [True]))) == 0b10000001
    for shape, p in (([3, 4096], 0.1), ([0, 8], 0.5), ([16], 1.0)):
        torch.library.opcheck(td.dropout_keep_bits, (s, shape, p))
        assert torch.equal(td.dropout_keep_bits(s, shape, p), td.reference_keep_bits(s, shape, p))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        f = td.dropout_keep_bits(torch.empty(1, dtype=torch.int64), [2, 24], 0.1)
    assert f.shape == (2, 3) and f.dtype == torch.uint8
    with pytest.raises(ValueError, match="multiple of 8"):
        td.reference_keep_bits(s, [4, 12], 0.1)


def test_kernel_compiles_for_hopper():
    """The keep-mask kernels compile for sm90 (Triton's compiler, not only its interpreter); the
    packed one draws each counter's Philox once, as the bool one does (the same count of high
    multiplies: a [BLOCK, 8] formulation drew it 8 times), and needs no shared memory."""
    pytest.importorskip("triton")
    from helpers import compile_for_hopper
    k = compile_for_hopper(td._keep_mask_kernel, dict(seed_ptr="*i64", out_ptr="*i1", n="i64", t="i32"),
                           dict(BLOCK=td.BLOCK), num_warps=td.NUM_WARPS)
    kb = compile_for_hopper(td._keep_bits_kernel, dict(seed_ptr="*i64", out_ptr="*u8", n_bytes="i64", t="i32"),
                            dict(BLOCK=td.BLOCK), num_warps=td.NUM_WARPS)
    mulhi = k.asm["ptx"].count("mul.hi.u32")
    assert mulhi > 0  # Philox's high multiplies, i.e. the generator was compiled in
    assert kb.asm["ptx"].count("mul.hi.u32") == mulhi and ".shared" not in kb.asm["ptx"]
