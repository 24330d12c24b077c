# Copied verbatim from the project's own baseline script ../shared/bench/anchors_gpt2.py
# (hpcmeg steering repo) so it travels to the GPU machine with the checkout; do not edit here,
# edit the original and re-copy. bench/train_throughput.py imports it (env LDH/MB/STEPS at import).
"""Anchor throughput for GPT-2 124M training on one GPU: what a user would pick instead.

Variants, each a full training step (fwd+bwd+AdamW) at seq 1024, bf16 autocast:
  hf_eager      transformers GPT2LMHeadModel, eager attention, torch AdamW (foreach)
  hf_sdpa       same, SDPA attention, fused AdamW
  hf_compile    hf_sdpa + torch.compile
  nano_compile  a minimal nanoGPT-style model, SDPA flash, fused AdamW, torch.compile
Prints tokens/s, MFU (6N + attention flops, against a measured bf16 matmul peak) and peak memory.
"""
import json, math, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
dev = "cuda"
L, D, H = (int(x) for x in os.environ.get("LDH", "12,768,12").split(","))
V, T = int(os.environ.get("VOCAB", 50257)), 1024
MB = int(os.environ.get("MB", 12))
STEPS = int(os.environ.get("STEPS", 30))


def peak_bf16():
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        a @ b
    e.record(); torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (s.elapsed_time(e) / 1e3)


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        s.qkv, s.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        s.fc, s.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(s, x):
        B, T_, _ = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T_, H, D // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(B, T_, D))
        return x + s.out(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))


class Nano(nn.Module):
    def __init__(s):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        s.blocks = nn.ModuleList(Block() for _ in range(L))
        s.lnf = nn.LayerNorm(D)
        s.head = nn.Linear(D, V, bias=False)
        s.head.weight = s.wte.weight

    def forward(s, idx, labels):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks:
            x = b(x)
        logits = s.head(s.lnf(x))
        return F.cross_entropy(logits.float().view(-1, V), labels.view(-1))


def hf_model(attn):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=L, n_embd=D, n_head=H, vocab_size=V, n_positions=T)
    m = GPT2LMHeadModel(cfg)
    m.config._attn_implementation = attn
    try:
        m.set_attn_implementation(attn)
    except Exception:
        pass
    return m


def run(name):
    torch.manual_seed(0)
    if name.startswith("hf"):
        m = hf_model("eager" if name == "hf_eager" else "sdpa").to(dev)
        step_fn = lambda x, y: m(input_ids=x, labels=y).loss
    else:
        m = Nano().to(dev)
        step_fn = lambda x, y: m(x, torch.roll(y, -1, 1))  # next-token labels (HF shifts internally)
    n_params = sum(p.numel() for p in m.parameters())
    fused = name != "hf_eager"
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, fused=fused)
    if name.endswith("_tuned"):
        step_fn = torch.compile(step_fn, mode="max-autotune-no-cudagraphs")
    elif "compile" in name:
        step_fn = torch.compile(step_fn)
    gen = torch.Generator(device=dev); gen.manual_seed(1)
    data = [torch.randint(0, V, (MB, T), device=dev, generator=gen) for _ in range(4)]

    def step(i):
        x = data[i % 4]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        return loss

    for i in range(5):
        step(i)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(STEPS):
        loss = step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / STEPS
    toks = MB * T / dt
    # non-embedding params for the 6N term is nanoGPT's convention; we use all params incl. tied embedding once (PaLM/Megatron style)
    flops_per_tok = 6 * n_params + 12 * L * D * T  # 6N + attention (fwd+bwd, causal not discounted)
    return dict(variant=name, micro_batch=MB, params_M=round(n_params / 1e6, 1), step_ms=round(dt * 1e3, 1),
                tokens_per_s=round(toks), tflops=round(toks * flops_per_tok / 1e12, 1),
                peak_mem_GB=round(torch.cuda.max_memory_allocated() / 1e9, 1), loss=round(loss.item(), 3))


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    pk = peak_bf16()
    print(f"measured bf16 matmul peak {pk/1e12:.0f} TFLOP/s", flush=True)
    out = []
    for v in sys.argv[1:] or ["hf_eager", "hf_sdpa", "hf_compile", "nano_compile"]:
        try:
            r = run(v)
            r["mfu_pct"] = round(100 * r["tflops"] * 1e12 / pk, 1)
        except Exception as ex:
            r = dict(variant=v, error=repr(ex)[:300])
        print(json.dumps(r), flush=True)
        out.append(r)
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        json.dump(dict(peak_tflops=pk / 1e12, LDH=[L, D, H], results=out), open(os.path.join(os.environ["OUT"], f"anchors_L{L}_D{D}_mb{MB}.json"), "w"), indent=1)
