"""The Triton kernels of hpcmeg/kernels/attention.py (causal flash attention with dropout): the
keep-bit draw, the forward, the backward's dQ and dK/dV kernels and the QKV bias gradient's final
sum, with their @triton.jit helpers. attention.py owns the launchers, the tile shapes
(Launch), the keep-mask layout these kernels implement, the plain twin and the custom ops; the
tests reach the kernels through it.

The algorithm is FlashAttention-2's (online softmax forward saving the log-sum-exp; backward per
query block for dQ, then per key block for dK/dV), causal only. The dQ kernel, which runs first,
also computes delta = rowsum(dO * O) for its rows (it loads dO anyway; a separate kernel re-read dO:
10.7 us per 124M layer call, profile_h200_s12_124M_gbs192_triton_attn.md) and leaves it for the
dK/dV kernel. With BIAS_GRAD both kernels also sum their fp32 dQ / dK, dV tiles over rows, and
_attn_bias_grad_kernel adds those row-block sums into the QKV bias gradient: no pass re-reading
dqkv for it (Inductor's reduction took 13.9 us per 124M layer call in the same profile).
Dropout is applied to the normalised probabilities inside the kernels, as in FlashAttention:
  O = (P * Z) V with Z = keep / (1 - p_eff), P = softmax(q k^T / sqrt(d) + causal mask) in fp32;
  backward: dV = (P * Z)^T dO, dP = (dO V^T) * Z, dS = P * (dP - delta), delta_i = dO_i . O_i.
The keep-mask is drawn once per call by a small kernel into bits ([b * h, s, s / 16] int16, 1/16
of the bf16 scores' size: 18.9 MB per layer at 124M, micro batch 12) that the forward and both
backward kernels read. (Regenerating the mask inside each kernel, one Philox call per 16 elements
plus the unpacking, cost 0.11 ms in the forward and 0.30 ms in the backward per layer at 124M on the
H200, more than the whole attention without dropout: bench/results/attention_probe_h200_s8a.json.)
A tile reads its bits as one [rows, cols / 16] block of words, expanded in registers (_keep_words): at
124M, p = 0.1, forward 0.144 ms and backward 0.270 ms against 0.218 and 0.385 when every element
loaded its own word (bench/results/attention_probe_h200_s9a.json). Drawing the bits costs
0.044 ms per layer (Philox's 32-bit multiplies: 4.7 M calls). With the backward above (dQ first,
computing delta itself; the QKV bias gradient from the kernels' row sums) these kernels are 12 %
faster than cuDNN per layer on an H100 (0.395 vs 0.451 ms forward + backward at 124M,
attention_probe_h100_s15.json) and +1.2 % tokens/s end to end (user_path_h100_s16.md): the
trainer's 'auto' on Hopper (hpcmeg/train/build.attention_backend_for).
The backward carries the dropout scale s inside P, through its log-sum-exp (lse - log2 s): it
computes P s, so dV = (P s keep)^T dO and dS = (P s)(dP keep - delta / s) need no multiply by s
per element.

Cost notes (static sm90 SASS, Triton 3.6's ptxas, head dim 64, p = 0.1; instructions per iteration
of the main loops): forward 432 (277 without dropout), dK/dV 356 / 310, dQ 185 / 248. The bits
kernel: 106 instructions per Philox call (16 keep bits) with _pack16's byte-parallel packing (142
packing bit by bit); at full issue rate its 4.7 M calls per 124M layer take ~15 us, while it
measured 0.044-0.050 ms, so its launch shape is part of Launch (bits_rows, bits_groups, bits_warps).
Why the forward reads the same bits as the backward (measured, bench/results/user_path_h200_s13.md):
a second copy of the bits for the forward, ordered as the wgmma accumulator's columns and applied to
bf16 pairs by one byte permute and one AND in inline PTX, took the forward loop from 495 to 344
instructions, but the forward kernel ran only ~4 % faster (0.099 -> 0.095 ms at 124M; it is not
bound by instruction issue) while the bits kernel, writing both layouts, went from 0.038 to 0.050 ms
per layer: a net loss.
Without Triton (a CPU-only install) this module defines nothing; the ops run the twin.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = tl = None

if triton is not None:
    @triton.jit
    def _ge_bytes(u, t4, nt4):
        """SWAR: for the 4 bytes b of uint32 u and a threshold byte t (t4 = t * 0x01010101, nt4 = ~t4),
        bit 7 of each byte of the result is b >= t (other bits garbage). The low 7 bits compare by a
        borrow-free subtraction, d = (u | 0x80) - (t & 0x7F) per byte, whose bit 7 is
        (b & 0x7F) >= (t & 0x7F); then b >= t = (b7 & ~t7) | (~(b7 ^ t7) & d7), one LOP3."""
        d = (u | 0x80808080) - (t4 & 0x7F7F7F7F)
        return (u & nt4) | ((u ^ nt4) & d)

    @triton.jit
    def _pack16(r0, r1, r2, r3, thresh):
        """One Philox call's 4 words -> the int32 word (16 bits) of its 16 columns: byte k of word w
        decides column 4k + w (bit = column). By bytes in parallel (_ge_bytes), the 16 results
        gathered with shifts and masks: ~24 instructions where a compare-and-select per byte took
        ~57 (sm90 SASS of _attn_bits_kernel: 142 -> 106 instructions per Philox call)."""
        t4 = thresh.to(tl.uint32) * 0x01010101
        nt4 = t4 ^ 0xFFFFFFFF  # ~t4 (the interpreter's ~ on uint32 overflows)
        # bit 7 + 8k of word w -> bit 8k + w: 16 bits at 0-3, 8-11, 16-19, 24-27 (byte k's 4 words)
        x = (_ge_bytes(r0.to(tl.uint32, bitcast=True), t4, nt4) >> 7) & 0x01010101
        x |= (_ge_bytes(r1.to(tl.uint32, bitcast=True), t4, nt4) >> 6) & 0x02020202
        x |= (_ge_bytes(r2.to(tl.uint32, bitcast=True), t4, nt4) >> 5) & 0x04040404
        x |= (_ge_bytes(r3.to(tl.uint32, bitcast=True), t4, nt4) >> 4) & 0x08080808
        x = (x | (x >> 4)) & 0x00FF00FF  # nibbles of bytes 0, 1 -> bits 0-7, of bytes 2, 3 -> 16-23
        return ((x | (x >> 8)) & 0xFFFF).to(tl.int32)  # -> bits 4k + w

    @triton.jit
    def _bits_tile(seed, BITS, S16, bh, pm, pn, thresh, R: tl.constexpr, G: tl.constexpr):
        # the words of rows pm * R .. + R - 1 x column groups pn * G .. + G - 1 of head bh
        rows = pm * R + tl.arange(0, R)
        groups = pn * G + tl.arange(0, G)
        c = rows[:, None].to(tl.int64) * S16 + groups[None, :].to(tl.int64)  # [R, G]
        r0, r1, r2, r3 = tl.randint4x(seed, (bh.to(tl.int64) << 32) | c)  # counter (c, bh, 0, 0)
        bits = _pack16(r0, r1, r2, r3, thresh)
        tl.store(BITS + bh.to(tl.int64) * (S16 * 16) * S16 + c, bits.to(tl.int16))

    @triton.jit
    def _attn_bits_kernel(seed_ptr, BITS, S, thresh, R: tl.constexpr, G: tl.constexpr):
        """The keep-mask as bits: BITS [b * h, s, s / 16] int16, bit j % 16 of word (i, j // 16) =
        keep(i, j); one program per tile of R rows x 16 * G columns (grid s / R, s / (16 G), b * h),
        those right of the diagonal return at once."""
        S16 = S // 16
        seed = tl.load(seed_ptr)
        pm, pn, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if pn * 16 * G <= pm * R + R - 1:
            _bits_tile(seed, BITS, S16, bh, pm, pn, thresh, R, G)

    @triton.jit
    def _keep_words(bits, rows, col0, S16, C: tl.constexpr):
        """The [R, C / 16] keep words of query rows `rows` x key columns col0 .. col0 + C of one head,
        loaded once (coalesced) and expanded in registers by _kept / _keep_mask (Triton moves the
        words into the scores' layout through shared memory); one int16 load per element instead
        took 0.218 + 0.385 ms forward + backward against 0.144 + 0.270 at 124M, p = 0.1
        (attention_probe_h200_s9a.json)."""
        return tl.load(bits + rows[:, None] * S16 + (col0 // 16 + tl.arange(0, C // 16))[None, :]).to(tl.int32)

    @triton.jit
    def _kept(bits, rows, col0, S16, R: tl.constexpr, C: tl.constexpr, TRANS: tl.constexpr):
        """bool keep tile [R, C] (TRANS: [C, R]), for tl.where: the dQ kernel's form. Its 32-column
        tiles compile shorter this way than with _keep_mask (sm90 SASS: 185 / 248 against 203 / 312
        instructions in its two loops)."""
        k3 = ((_keep_words(bits, rows, col0, S16, C)[:, :, None] >> tl.arange(0, 16)[None, None, :]) & 1)
        keep = tl.reshape(k3.to(tl.int8), (R, C)) != 0
        if TRANS:
            keep = tl.trans(keep)
        return keep

    @triton.jit
    def _keep_mask(bits, rows, col0, S16, R: tl.constexpr, C: tl.constexpr, TRANS: tl.constexpr):
        """int32 keep tile [R, C] (TRANS: [C, R]) of 0 (dropped) or -1 (kept), for _drop: bit j moved
        to the sign, then an arithmetic shift. The forward and dK/dV kernels' form (sm90 SASS: their
        loops 466 -> 432 and 385 / 327 -> 356 / 310 instructions against _kept + tl.where)."""
        k3 = (_keep_words(bits, rows, col0, S16, C)[:, :, None] << (31 - tl.arange(0, 16))[None, None, :]) >> 31
        keep = tl.reshape(k3, (R, C))
        if TRANS:
            keep = tl.trans(keep)
        return keep

    @triton.jit
    def _drop(x, keep):
        # fp32 x where keep is -1, +0.0 where it is 0: one AND per element
        return (x.to(tl.int32, bitcast=True) & keep).to(tl.float32, bitcast=True)

    @triton.jit
    def _fwd_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, s_s, bits, rows, lo, hi, S16, qk_scale,
                   BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DIAG: tl.constexpr,
                   DROPOUT: tl.constexpr):
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        for start_n in range(lo, hi, BN):
            cols = start_n + offs_n
            kt = tl.load(k_ptr + cols[None, :] * s_s + offs_d[:, None])  # [D, BN]
            qk = tl.dot(q, kt)  # raw scores, fp32 [BM, BN]; times qk_scale: log2 units
            if DIAG:
                qk = tl.where(rows[:, None] >= cols[None, :], qk, float("-inf"))
            # qk_scale > 0, so the row max scales with it (bit for bit: rounding is monotonic): one
            # multiply per row, and the scale rides in exp2's FFMA instead of a multiply per element
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser counts dropped entries too
            acc = acc * alpha[:, None]
            if DROPOUT:
                p = _drop(p, _keep_mask(bits, rows, start_n, S16, BM, BN, False))
            v = tl.load(v_ptr + cols[:, None] * s_s + offs_d[None, :])  # [BN, D]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attn_fwd_kernel(QKV, O, LSE, BITS, s_b, s_s, s_h, o_b, o_s, o_h, H, S, thresh, keep_scale, qk_scale,
                         D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DROPOUT: tl.constexpr):
        start_m = tl.program_id(0)  # grid (query blocks, b * h)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        base = QKV + b.to(tl.int64) * s_b + h * s_h
        rows = start_m * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        q = tl.load(base + rows[:, None] * s_s + offs_d[None, :])
        S16 = S // 16
        bits = BITS + bh.to(tl.int64) * S * S16  # this head's keep bits
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        # keys strictly left of the diagonal block: no mask; then the diagonal block, masked
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, base + D, base + 2 * D, s_s, bits, rows, 0, start_m * BM,
                                   S16, qk_scale, BM, BN, D, False, DROPOUT)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, base + D, base + 2 * D, s_s, bits, rows, start_m * BM,
                                   start_m * BM + BM, S16, qk_scale, BM, BN, D, True, DROPOUT)
        out = acc / l_i[:, None]
        if DROPOUT:
            out = out * keep_scale
        o_base = O + b.to(tl.int64) * o_b + h * o_h
        tl.store(o_base + rows[:, None] * o_s + offs_d[None, :], out.to(O.dtype.element_ty))
        tl.store(LSE + bh.to(tl.int64) * S + rows, m_i + tl.math.log2(l_i))

    @triton.jit
    def _dkv_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, s_s, o_s, bits, col0, cols, lo, hi, S16,
                   keep_scale, qk_scale, BN: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
                   DIAG: tl.constexpr, DROPOUT: tl.constexpr):
        offs_m = tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        # with dropout, pt below is P^T * keep_scale (the scale enters through the log-sum-exp), so
        # dV = (P * Z)^T dO takes the bare mask and dS = P * (dP * Z - delta) becomes
        # (P * s) * (dP * keep - delta / s): no multiply per element for the scale
        lse_shift = tl.math.log2(keep_scale) if DROPOUT else 0.0
        delta_scale = 1.0 / keep_scale if DROPOUT else 1.0
        for start_m in range(lo, hi, BM):
            rows = start_m + offs_m
            qt = tl.load(q_ptr + rows[None, :] * s_s + offs_d[:, None])  # [D, BM]
            lse = tl.load(lse_ptr + rows) - lse_shift
            pt = tl.math.exp2(tl.dot(k, qt) * qk_scale - lse[None, :])  # P^T (* s) [BN, BM], fp32
            if DIAG:
                pt = tl.where(rows[None, :] >= cols[:, None], pt, 0.0)
            do = tl.load(do_ptr + rows[:, None] * o_s + offs_d[None, :])  # [BM, D]
            dpt = tl.dot(v, tl.trans(do))  # (dO V^T)^T [BN, BM]
            if DROPOUT:
                keep = _keep_mask(bits, rows, col0, S16, BM, BN, True)  # [BN, BM]
                pdt = _drop(pt, keep)
                dpt = _drop(dpt, keep)
            else:
                pdt = pt
            dv = tl.dot(pdt.to(do.dtype), do, dv)
            delta = tl.load(delta_ptr + rows) * delta_scale
            dst = pt * (dpt - delta[None, :])  # dS^T [BN, BM]
            dk = tl.dot(dst.to(do.dtype), tl.trans(qt), dk)
        return dk, dv

    @triton.jit
    def _attn_dkv_kernel(QKV, DO, LSE, DELTA, DQKV, BITS, PKV, s_b, s_s, s_h, o_b, o_s, o_h, H, S, thresh,
                         keep_scale, qk_scale, sm_scale, D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                         DROPOUT: tl.constexpr, BIAS_GRAD: tl.constexpr):
        start_n = tl.program_id(0) * BN  # grid (key blocks, b * h)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        base = b.to(tl.int64) * s_b + h * s_h  # same strides for qkv and dqkv
        cols = start_n + tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        kv_offs = cols[:, None] * s_s + offs_d[None, :]
        k = tl.load(QKV + base + D + kv_offs)
        v = tl.load(QKV + base + 2 * D + kv_offs)
        S16 = S // 16
        bits = BITS + bh.to(tl.int64) * S * S16  # this head's keep bits
        do_ptr = DO + b.to(tl.int64) * o_b + h * o_h
        lse_ptr = LSE + bh.to(tl.int64) * S
        delta_ptr = DELTA + bh.to(tl.int64) * S
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        # queries on the diagonal block (masked), then every later query block (unmasked)
        dk, dv = _dkv_tiles(dk, dv, k, v, QKV + base, do_ptr, lse_ptr, delta_ptr, s_s, o_s, bits, start_n,
                            cols, start_n, start_n + BN, S16, keep_scale, qk_scale, BN, BM, D, True,
                            DROPOUT)
        dk, dv = _dkv_tiles(dk, dv, k, v, QKV + base, do_ptr, lse_ptr, delta_ptr, s_s, o_s, bits, start_n,
                            cols, start_n + BN, S, S16, keep_scale, qk_scale, BN, BM, D, False,
                            DROPOUT)
        # the scores were q.k * sm_scale: dK = sm_scale * dS^T Q
        dk = dk * sm_scale
        tl.store(DQKV + base + D + kv_offs, dk.to(DQKV.dtype.element_ty))
        tl.store(DQKV + base + 2 * D + kv_offs, dv.to(DQKV.dtype.element_ty))
        if BIAS_GRAD:  # this block's rows of dK, dV summed (fp32, before rounding): PKV [b, S / BN, H, 2, D]
            part = PKV + ((b.to(tl.int64) * (S // BN) + start_n // BN) * H + h) * (2 * D) + offs_d
            tl.store(part, tl.sum(dk, 0))
            tl.store(part + D, tl.sum(dv, 0))

    @triton.jit
    def _dq_tiles(dq, q, do, lse, delta, k_ptr, v_ptr, s_s, bits, rows, lo, hi, S16,
                  qk_scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DIAG: tl.constexpr,
                  DROPOUT: tl.constexpr):
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        for start_n in range(lo, hi, BN):
            cols = start_n + offs_n
            kt = tl.load(k_ptr + cols[None, :] * s_s + offs_d[:, None])  # [D, BN]
            vt = tl.load(v_ptr + cols[None, :] * s_s + offs_d[:, None])  # [D, BN]
            p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse[:, None])  # [BM, BN]
            if DIAG:
                p = tl.where(rows[:, None] >= cols[None, :], p, 0.0)
            dp = tl.dot(do, vt)
            if DROPOUT:  # p is P * keep_scale and delta is delta / keep_scale (_attn_dq_kernel)
                dp = tl.where(_kept(bits, rows, start_n, S16, BM, BN, False), dp, 0.0)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(q.dtype), tl.trans(kt), dq)
        return dq

    @triton.jit
    def _attn_dq_kernel(QKV, O, DO, LSE, DELTA, DQKV, BITS, PQ, s_b, s_s, s_h, o_b, o_s, o_h, H, S, thresh,
                        keep_scale, qk_scale, sm_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        DROPOUT: tl.constexpr, BIAS_GRAD: tl.constexpr):
        start_m = tl.program_id(0) * BM  # grid (query blocks, b * h)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        base = b.to(tl.int64) * s_b + h * s_h
        rows = start_m + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        q = tl.load(QKV + base + rows[:, None] * s_s + offs_d[None, :])
        o_offs = b.to(tl.int64) * o_b + h * o_h + rows[:, None] * o_s + offs_d[None, :]  # O and dO share strides
        do = tl.load(DO + o_offs)
        lse = tl.load(LSE + bh.to(tl.int64) * S + rows)
        # delta_i = dO_i . O_i (fp32) for this block's rows, kept for the dK/dV kernel that runs next
        delta = tl.sum(tl.load(O + o_offs).to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh.to(tl.int64) * S + rows, delta)
        if DROPOUT:  # dS = P * (dP * Z - delta) = (P * s) * (dP * keep - delta / s), Z = keep * s:
            lse -= tl.math.log2(keep_scale)  # P * s through the log-sum-exp, no multiply per element
            delta = delta / keep_scale
        S16 = S // 16
        bits = BITS + bh.to(tl.int64) * S * S16  # this head's keep bits
        dq = tl.zeros([BM, D], tl.float32)
        dq = _dq_tiles(dq, q, do, lse, delta, QKV + base + D, QKV + base + 2 * D, s_s, bits, rows, 0, start_m,
                       S16, qk_scale, BM, BN, D, False, DROPOUT)
        dq = _dq_tiles(dq, q, do, lse, delta, QKV + base + D, QKV + base + 2 * D, s_s, bits, rows, start_m,
                       start_m + BM, S16, qk_scale, BM, BN, D, True, DROPOUT)
        dq = dq * sm_scale
        tl.store(DQKV + base + rows[:, None] * s_s + offs_d[None, :], dq.to(DQKV.dtype.element_ty))
        if BIAS_GRAD:  # this block's rows of dQ summed (fp32, before rounding): PQ [b, S / BM, H, D]
            tl.store(PQ + ((b.to(tl.int64) * (S // BM) + start_m // BM) * H + h) * D + offs_d, tl.sum(dq, 0))

    @triton.jit
    def _attn_bias_grad_kernel(PQ, PKV, DBIAS, NQ, NK, H, D: tl.constexpr, ROWS: tl.constexpr):
        """The QKV bias gradient [H, 3, D] (per head its q, k, v parts, the QKV weight's row order) from
        the dQ and dK/dV kernels' row-block sums: program (h, c) adds the NQ (c = 0, from PQ [NQ, H, D])
        or NK (c = 1, 2, from PKV [NK, H, 2, D]) partial rows of its D columns in a fixed order."""
        h, c = tl.program_id(0), tl.program_id(1)
        offs_d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        if c == 0:
            for r0 in range(0, NQ, ROWS):
                r = r0 + tl.arange(0, ROWS)
                t = tl.load(PQ + (r.to(tl.int64)[:, None] * H + h) * D + offs_d[None, :], mask=r[:, None] < NQ,
                            other=0.0)
                acc += tl.sum(t, 0)
        else:
            for r0 in range(0, NK, ROWS):
                r = r0 + tl.arange(0, ROWS)
                t = tl.load(PKV + (r.to(tl.int64)[:, None] * H + h) * (2 * D) + (c - 1) * D + offs_d[None, :],
                            mask=r[:, None] < NK, other=0.0)
                acc += tl.sum(t, 0)
        tl.store(DBIAS + (h * 3 + c) * D + offs_d, acc.to(DBIAS.dtype.element_ty))
