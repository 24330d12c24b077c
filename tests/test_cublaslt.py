"""hpcmeg/model/cublaslt.py (gelu_impl 'cublaslt'): the twins against autograd, the custom ops
(opcheck), the model's MLP with it against the Triton GELU path (eager, compiled, with main-grad
sinks), and, where a libcublasLt is at hand ($HPCMEG_CUBLASLT_LIB, e.g. from the nvidia-cublas
wheel), that the library accepts every descriptor the module builds (the GEMMs themselves need a
GPU: bench/gpu_agreement.py --parts lt checks them against the twins on the H200).
Tolerances: tests/TOLERANCES.md's cases, named at each comparison."""
from __future__ import annotations

import ctypes
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from hpcmeg.model import cublaslt
from hpcmeg.model.config import GPTConfig
from hpcmeg.model.gpt import GPT


def test_twins_against_autograd():
    torch.manual_seed(0)
    x, w1, b1, w2 = torch.randn(10, 8), torch.randn(12, 8), torch.randn(12), torch.randn(6, 12)
    g, h = cublaslt.reference_gelu_aux(x, w1, b1)
    # the twin calls F.linear itself (case 1, under case 5's default tolerance); its written-out tanh
    # formula against torch's GELU kernel: the same formula, a few roundings apart (case 5)
    torch.testing.assert_close(h, F.linear(x, w1, b1))
    torch.testing.assert_close(g, F.gelu(h, approximate="tanh").to(g.dtype))
    # dh = (dy W2) * GELU'(h) and its row sum: autograd of out = GELU(h) W2^T
    hh = h.clone().requires_grad_(True)
    dy = torch.randn(10, 6)
    (want,) = torch.autograd.grad(F.linear(F.gelu(hh, approximate="tanh"), w2), hh, dy)
    dh, db = cublaslt.reference_dgelu_bgrad(dy, w2, h)
    # case 2: gelu'(h) written out against autograd's tanh-GELU backward, then a row sum
    torch.testing.assert_close(dh, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(db, want.sum(0), atol=1e-5, rtol=1e-5)


def test_ops_opcheck_and_cpu_path():
    torch.manual_seed(1)
    x, w, b = torch.randn(16, 8), torch.randn(24, 8), torch.randn(24)
    torch.library.opcheck(cublaslt.linear_gelu_aux, (x, w, b))
    g, h = torch.ops.hpcmeg.linear_gelu_aux(x, w, b)  # CPU: the twin
    assert g.shape == h.shape == (16, 24) and g.is_contiguous()
    dy, w2 = torch.randn(16, 8), torch.randn(8, 24)
    torch.library.opcheck(cublaslt.linear_dgelu_bgrad, (dy, w2, h))
    dh, db = torch.ops.hpcmeg.linear_dgelu_bgrad(dy, w2, h)
    assert dh.shape == (16, 24) and db.shape == (24,)
    # gelu_impl 'cublaslt_dgelu''s two: dh alone, and fc1's weight gradient with its bias gradient
    torch.library.opcheck(cublaslt.linear_dgelu, (dy, w2, h))
    # on CPU the op runs the twin, and reference_dgelu is reference_dgelu_bgrad's dh: case 1 (default tolerance)
    torch.testing.assert_close(torch.ops.hpcmeg.linear_dgelu(dy, w2, h), cublaslt.reference_dgelu(dy, w2, h))
    torch.testing.assert_close(cublaslt.reference_dgelu(dy, w2, h), dh)
    flat = torch.randn(3 + 24 * 8)  # the main grad of a [24, 8] weight at offset 3, already holding a sum
    torch.library.opcheck(cublaslt.wgrad_bgrad_, (flat.clone(), dh, x, 3))
    before = flat.clone()
    db_f = torch.ops.hpcmeg.wgrad_bgrad_(flat, dh, x, 3)
    assert db_f.dtype == dh.dtype and db_f.shape == (24,)
    torch.testing.assert_close(db_f, dh.sum(0))  # the same row sum, maybe in another order: case 5
    dh16 = dh.bfloat16()  # bf16 gradients: the bias gradient summed in fp32, rounded once to bf16
    assert torch.equal(torch.ops.hpcmeg.wgrad_bgrad_(flat.clone(), dh16, x.bfloat16(), 3),
                       dh16.float().sum(0).bfloat16())
    # added, not set: the op's GEMM accumulating into the slice against GEMM then add, one rounding apart (case 5)
    torch.testing.assert_close(flat[3:].view(24, 8), before[3:].view(24, 8) + dh.t() @ x)
    assert torch.equal(flat[:3], before[:3])  # nothing outside the weight's slice


def _cfg(**kw):
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                     max_position_embeddings=64, padded_vocab_size=128, fused=True, hidden_dropout=0.0,
                     attention_dropout=0.0, **kw)


def test_model_mlp_matches_the_triton_gelu_path_eager_compiled_and_sunk():
    """The fused model with gelu_impl 'cublaslt' (its twins on CPU) against 'triton' (the Triton GELU
    twins): loss and every gradient, eager and under torch.compile; then TrainStep with main-grad
    sinks (fc1's and fc2's weight gradients added into the buffer by _MLPCublasLt's backward)."""
    tok = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    grads = {}
    impls = ("triton", "cublaslt", "cublaslt_dgelu")
    for impl in impls:
        m = GPT(_cfg(gelu_impl=impl), init_seed=3)
        loss = m(tok, tok).mean()
        loss.backward()
        grads[impl] = (loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
        if impl != "triton":
            m.zero_grad()
            lc = torch.compile(m)(tok, tok).mean()
            lc.backward()
            # compiled against eager: Inductor's fused kernels reorder (case 2) on a scalar mean loss ~5,
            # within the default's atol 1e-5 (~30 ulps of it); the gradients through two layers: case 3
            torch.testing.assert_close(lc, loss)
            for n, p in m.named_parameters():
                torch.testing.assert_close(p.grad, grads[impl][1][n], atol=1e-5, rtol=1e-4, msg=n)
    for impl in impls[1:]:  # the GELU twins of other modules: the loss as above, the gradients case 3
        torch.testing.assert_close(grads[impl][0], grads["triton"][0])
        for n, want in grads["triton"][1].items():
            torch.testing.assert_close(grads[impl][1][n], want, atol=1e-5, rtol=1e-4, msg=f"{impl} {n}")
        assert grads[impl][1]["encoder.layers.0.mlp.dense_h_to_4h.bias"].abs().sum() > 0

    from hpcmeg.train.optim import build_optimizer
    from hpcmeg.train.step import TrainStep
    mbs = [(tok[:, :-1].contiguous(), tok[:, 1:].contiguous())] * 2
    main = {}
    for impl in impls:  # 'cublaslt_dgelu': fc1's bias gradient from wgrad_bgrad_, its weight's added into the buffer
        m = GPT(_cfg(gelu_impl=impl), init_seed=3)
        buf, opt = build_optimizer(m, 1e-3, bucket_numel=5000, wgrad_fusion=True)
        assert buf.is_sunk(m.encoder.layers[0].mlp.dense_4h_to_h.weight)
        TrainStep(m, buf, opt, "fp32", grad_clip=0.0, device="cpu").run(mbs)
        main[impl] = {n: buf.grad_data[slice(*buf.locate(p))].clone() for n, p in m.named_parameters()}
    for impl in impls[1:]:  # case 3; atol 1e-6: two micro batches' gradients of a mean loss, mostly ~1e-3..1e-2
        for n, want in main["triton"].items():
            torch.testing.assert_close(main[impl][n], want, atol=1e-6, rtol=1e-4, msg=f"{impl} {n}")
    with pytest.raises(ValueError, match="gelu_impl"):
        dataclasses.replace(_cfg(), gelu_impl="cublas")


def _library() -> str:
    path = os.environ.get(cublaslt.LIB_ENV)
    if not path:
        pytest.skip(f"no libcublasLt here (set ${cublaslt.LIB_ENV} to one, e.g. from the nvidia-cublas wheel)")
    return path


def test_the_library_accepts_every_descriptor_the_gemms_build():
    """Each attribute's size and value is checked by cuBLASLt itself (a wrong size answers
    CUBLAS_STATUS_INVALID_VALUE): the layouts of both GEMMs, both epilogue descriptors, the
    workspace preference. Without a GPU the library cannot create a handle, so no heuristic runs."""
    lt = cublaslt.Lt(_library())
    m_tok, k, n = 12288, 768, 3072
    for dims in ((k, n, k), (k, m_tok, k), (n, m_tok, n)):  # A (transposed W1), B (x), D / aux
        lt.lib.cublasLtMatrixLayoutDestroy(lt.layout(cublaslt._R_16BF, *dims))
    for trans, epi in (((cublaslt._OP_T, cublaslt._OP_N), cublaslt._EPILOGUE_GELU_AUX_BIAS),
                       ((cublaslt._OP_N, cublaslt._OP_N), cublaslt._EPILOGUE_DGELU_BGRAD),
                       ((cublaslt._OP_N, cublaslt._OP_N), cublaslt._EPILOGUE_DGELU)):
        lt.lib.cublasLtMatmulDescDestroy(lt.matmul_desc(*trans, epi, 1 << 20, 2 << 20, n))
    lt.lib.cublasLtMatmulDescDestroy(lt.matmul_desc(cublaslt._OP_N, cublaslt._OP_N, cublaslt._EPILOGUE_DGELU, 0,
                                                    2 << 20, n))  # no bias pointer: linear_dgelu's
    # wgrad_bgrad_: fp32 D (the main grad), the BGRADB epilogue, a bias type named (here bf16 against
    # fp32 D, the attribute's path; the op itself leaves D's type)
    lt.lib.cublasLtMatrixLayoutDestroy(lt.layout(cublaslt._R_32F, k, n, k))
    lt.lib.cublasLtMatmulDescDestroy(lt.matmul_desc(cublaslt._OP_N, cublaslt._OP_T, cublaslt._EPILOGUE_BGRADB,
                                                    1 << 20, 0, 0, cublaslt._R_16BF))
    lt.lib.cublasLtMatmulPreferenceDestroy(lt.preference())
    lt.lib.cublasLtMatmulPreferenceDestroy(lt.preference(128, 256, 256))  # a buffer-view weight's alignment
    x = torch.empty(64, dtype=torch.bfloat16)
    assert cublaslt._alignment(x, x[8:], x[1:]) == (min(x.data_ptr() & -x.data_ptr(), 256), 16, 2)
    desc = lt.matmul_desc(0, 0, 1, 0, 0, 8)
    try:  # the check would catch a wrong size: the epilogue is a 4-byte enum
        with pytest.raises(cublaslt.LtError, match="attribute 7"):
            lt._set(desc, cublaslt._DESC_EPILOGUE, ctypes.c_uint64(1))
    finally:
        lt.lib.cublasLtMatmulDescDestroy(desc)


@pytest.mark.parametrize("kind", ["not_a_library", "lacks_the_symbols"])
def test_an_unusable_library_warns_and_the_mlp_falls_back(kind, tmp_path, monkeypatch):
    """gelu_impl 'cublaslt_dgelu' is the default: a library that does not load (a stub, another CUDA
    major's file) or lacks cuBLASLt's symbols must mean one warning and the Triton GELU path."""
    import ctypes.util

    if kind == "not_a_library":
        path = tmp_path / "libcublasLt.so.99"
        path.write_bytes(b"not an ELF file")
        path = str(path)
    else:
        path = ctypes.util.find_library("c")  # loads, but has no cublasLtCreate
        if path is None:
            pytest.skip("no libc to load")
    monkeypatch.setenv(cublaslt.LIB_ENV, path)
    cublaslt._lt_for.cache_clear()
    try:
        with pytest.warns(UserWarning, match="unusable"):
            assert cublaslt.lt() is None
    finally:
        cublaslt._lt_for.cache_clear()


def test_the_library_accepts_the_gemm_probes_descriptors():
    """bench/dev/gemm_probe.py's weight-gradient problem (bf16 A/B, fp32 C/D, the default epilogue, B
    transposed) for every GEMM of the three sizes: layouts and descriptor accepted by cuBLASLt."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "dev"))
    import gemm_probe

    lt = cublaslt.Lt(_library())
    for size in gemm_probe.SIZES:
        for _, out_f, in_f, t in gemm_probe.problems(size):
            dy, x = (torch.empty(t, n, dtype=torch.bfloat16, device="meta") for n in (out_f, in_f))
            p = gemm_probe.Problem(lt, dy, x, torch.empty(out_f, in_f, device="meta"))
            p.close()
