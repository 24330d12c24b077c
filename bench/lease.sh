#!/usr/bin/env bash
# The next GPU lease in one `run` call (< 600 s): the open timing questions of issue 19, in order of
# what they decide, each step under its own timeout and all under one budget, every result in $OUT.
#
#   bash bench/lease.sh [STAGE ...]        stages, run in the order given (default: bdaln u1.3B, for the one
#                                          target still missed after session 19; then `a1.3B u1.3B`):
#     probes  attention tiles (bench/dev/attention_probe.py: heavy-first launch order, the forward drawing
#             its own keep bits (fwd_draw, session 20) and tile variants
#             against the defaults at 124M, 355M and 1.3B, p = 0.1, and cuDNN timed as the model
#             calls it; writes attention_best_<size>.txt after each size), the hidden-dropout
#             keep-mask on the GPU against its twin bit for bit and its time (bench/gpu_agreement.py
#             --parts dropout)
#     quick   the probes' short form: default tiles and heavy_first at 124M and 355M only, the keep-bits
#             kernel's launch variants (one program per row block, taller tiles, more warps), agreement
#             with the twin at the default tiles; the CE kernel's launches (bench/dev/ce_probe.py: prefetch,
#             reversed second sweep, chunk and warps: 0.95 ms per 124M micro batch on the H200, ~4 %
#             of it, about 1.9x its one-read-one-write floor; writes ce_best.txt, which the u stages
#             then time in the user path when it is not the default) (~90 s)
#     ce      the CE kernel's launches alone (bench/dev/ce_probe.py at micro 12's and 16's rows; session 17,
#             H100: block=8192+warps=16+prefetch=1+reverse=1 14 % under the default launch, +0.2 %
#             tokens/s in the 124M user path, within its noise) (~40 s)
#     u124 | u355 | u1.3B
#             the user path (bench/user_path.py) at that size: nano, hpcmeg as shipped (session 16's
#             defaults: triton_bits, Triton attention on Hopper; session 19's gelu_impl cublaslt_dgelu), then the probes'
#             winners where they are not the defaults: the CE launch (ce_best.txt; 124M, 355M) at
#             micro batch 12 and 16 x 12; the Triton attention at attention_best_<size>.txt; at 124M
#             plain micro 16 (9.27 GB on the H100 against the anchor's 9.19) and micro 16 with
#             model.recompute_gelu_layers 1 and 2 (100 MB less each, for one GELU pass a layer; session
#             18: 1.305-1.308x at 9.10 GB), at 355M micro 16 with backward_in_forward (session 18:
#             1.196x at 20.98 GB against 21.75; session 19 with gelu_impl cublaslt_dgelu: 1.203x); the
#             bias-dropout-add + LayerNorm forward kernel (layernorm_impl triton_forward, untimed); the
#             A/B rows of the defaults (cuDNN attention; gelu_impl cublaslt, session 18's; gelu_impl
#             triton), as far as the budget goes (the probes' files from this call, else from $LEASE_BEST)
#     uall    the acceptance row of issue 19 in ONE call: at 124M, 355M and 1.3B the nanoGPT anchor and
#             the best known hpcmeg row (124M: micro 16 + recompute_gelu_layers 1; 355M: micro 16 +
#             backward_in_forward; 1.3B: as shipped; UALL_EXTRA adds settings to every hpcmeg row,
#             e.g. "|model.layernorm_impl=triton_forward" once that wins). Run it as a lease's
#             second or later call on the same warm machine: the first call's Inductor and Triton
#             caches (/tmp, ~/.triton) then spare most of the compile time, which made the six
#             rows ~575 s cold in session 19
#     b124 | b355
#             model.cross_entropy backward_in_forward (the LM head's backward GEMMs in its forward, no
#             [tokens, vocab] gradient kept): sessions 16 and 17 measured it 4 % slower at 124M micro
#             16 on the H100, with a copy of the 0.5 GB main-grad buffer per micro batch that session
#             17 found and removed afterwards (commit ebea1c3); these rows (nano,
#             shipped, backward_in_forward at micro 12, 16 and 24 / at 355M micro 12 and 16, plain
#             micro 16) say whether that holds on this GPU; pbif profiles it
#     gemm    the weight-gradient GEMMs (bench/dev/gemm_probe.py): torch's addmm into the fp32 main grad, as
#             the model runs it, against each algorithm of cuBLASLt's heuristic list for the same
#             problem, at $GEMM_SIZES (default 124M,355M,1.3B; ~50 s a size). Session 17, H100, 124M:
#             torch's choice (split-K + its reduce) was the fastest but for 3 % on the smallest GEMM
#     checks  the fused model on the GPU against the plain one and TrainStep eager / compiled / CUDA
#             graphs; the keep-masks (bool and packed) against their twins bit for bit, their cost in
#             the compiled bias-dropout-add + LayerNorm, triton_bits' training curve against triton's
#             (bench/gpu_agreement.py --parts wgrad,ltstep,model,dropout: in that order,
#             backward_in_forward through CUDA graphs first, then the CUDA-graphed step with
#             gelu_impl cublaslt against triton, each part's rows on disk as soon as it ends)
#     p124    where the 124M user path's time goes (bench/profile_step.py, dropout 0.1, global batch
#             192, as shipped)
#     p124m16 the same at micro batch 16 x accumulation 12 (session 13: 3 % faster than micro 12;
#             the two profiles side by side say which per-micro-batch work does not grow with its size)
#     mlpbwd  the MLP backward's GELU (bench/dev/mlp_bwd_probe.py, ~60 s): session 18's GEMM + Triton GELU
#             backward + fc1 weight-gradient GEMM against gelu_impl cublaslt_dgelu (cuBLASLt's DGELU
#             epilogue in fc2's input-gradient GEMM, the bias gradient by the BGRADB epilogue of fc1's
#             weight-gradient GEMM; the default since session 19: 1-6 % faster per MLP backward) at
#             124M (micro 12 and 16), 355M and 1.3B, checked against the twin
#     bdaln   the bias-dropout-add + LayerNorm forward kernel (layernorm_impl triton_forward, session 19,
#             untimed so far; since session 20 it draws the packed keep-mask itself with triton_bits)
#             against its fp64 twin, its drawn bits against the keep-bits kernel's, and timed against
#             Inductor's compiled plain ops + the keep-bits kernel at the three sizes' shapes
#             (bench/gpu_agreement.py --parts bdaln, ~30 s). Inductor's kernel reads each row twice
#             above hidden 1024: 92 us per [8192, 2048] call at 1.3B on the H100
#     a1.3B   attention tiles at 1.3B's head dim 128 only (bench/dev/attention_probe.py, p = 0.1; ~60 s):
#             the default tiles were tuned at head dim 64 and checked at 128 only against a few
#             variants (H200, session 12); these add 32-wide key steps, 8 warps, 16-row backward
#             steps and 128-key dK/dV blocks on 8 warps (session 20, static: all compile for sm90
#             without spills and on wgmma; 32-row blocks fall back to mma.sync), and the forward
#             drawing its own keep bits (fwd_draw, no bits kernel); writes attention_best_1.3B.txt
#             for a later u1.3B
#     p355 | p1.3B
#             where the 355M (micro 12, global 192) and 1.3B (micro 8, global 64) user paths' time goes,
#             dropout 0.1, as shipped (session 19, H100, 1.3B: GEMMs 73 % of the GPU time, attention
#             14 %: bench/results/profile_h100_s19_1.3B_gbs64.md)
#     pbif    the same at micro 16 with model.cross_entropy backward_in_forward: where its 4 % goes
#     pops    which host op launches each kernel and memset of the 124M step (bench/profile_step.py --ops
#             --no-cudagraphs, global batch 24): the CUDA-graph profiles show a memset before every bias
#             GEMM and before some cuDNN calls, each followed by ~4 us of idle GPU (~0.8 % of the step);
#             its log also holds Inductor's generated code (TORCH_LOGS=output_code), which says what the
#             ~74 one-microsecond `triton_poi_fused__to_copy_1` casts per micro batch convert
#     loss    loss parity with Hugging Face over 400 steps at 124M (bench/loss_parity.py; dropout 0), the
#             shipped defaults (gelu_impl cublaslt_dgelu since session 19), the 1.3B candidates
#             (layernorm_impl triton_forward) and backward_in_forward
# Environment: OUT (results; default /tmp/hpcmeg-lease), LEASE_BUDGET_S (default 570), TOK (GPT-2
# encoder.json + vocab.bpe; default .tok, carried to the device as its README says), LEASE_BEST (a
# folder in the tree with an earlier call's attention_best_<size>.txt, for a call without the
# probes stage).
# Why one script: a lease is ~30 device-minutes with a ~3-minute start, and starts are refused or
# machines taken back without notice (session 10 lost most of its lease that way), so one call has
# to answer as much as it can and leave what it measured on disk even when a step is cut short.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/hpcmeg-lease}
TOK=${TOK:-.tok}
BUDGET=${LEASE_BUDGET_S:-570}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
export HPCMEG_COMMIT=${HPCMEG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
START=$SECONDS

left() { echo $((BUDGET - (SECONDS - START))); }

# step NAME MAX_S CMD...: CMD under timeout min(MAX_S, what is left - 5 s), its output in $OUT/NAME.log
step() {
    local name=$1 max=$2 l t
    shift 2
    l=$(left)
    t=$((max < l - 5 ? max : l - 5))
    if ((t < 30)); then
        echo "== $name: skipped, ${l} s left" | tee -a "$OUT/lease.log"
        return 0
    fi
    echo "== $name (timeout $t s, $l s left): $*" | tee -a "$OUT/lease.log"
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - START)) s" | tee -a "$OUT/lease.log"
    tail -n 25 "$OUT/$name.log"
}

# user_path SIZE MAX_S TAG ITEMS: bench/user_path.py's rows ITEMS at SIZE, as one step
user_path() {
    step "user_path_$3" "$2" python bench/user_path.py --sizes "$1" --tok "$TOK" --tag "lease_$3" \
        --budget-s $(($(left) - 60)) --items "$4"
}

# u124 | u355 | u1.3B: the shipped defaults against the anchor, then micro 16 and the A/B rows
best_file() {  # best_file NAME: a probe's pick from this call's $OUT, else $LEASE_BEST, else 'default'
    local d
    for d in "$OUT" "${LEASE_BEST:-}"; do
        [[ -n $d && -s $d/$1 ]] && { cat "$d/$1"; return; }
    done
    echo default
}

best_attention() {  # best_attention SIZE: the probes' best Triton tiles (this call's, then an earlier call's)
    best_file "attention_best_$1.txt"
}

user_path_u() {  # user_path_u SIZE MAX_S
    local size=$1 max=$2 attn items ce
    attn=$(best_attention "$size")
    ce=$(best_file ce_best.txt)  # the ce stage's CE launch, if it won
    [[ $size == 124M || $size == 355M ]] || ce=default  # (the CE probe timed 124M's and 355M's rows)
    # rows in order of what they decide, so --budget-s drops the least important: the anchor, the
    # shipped defaults, the CE launch where it is not the default (at micro 12, then micro 16 x 12
    # for 124M and 355M), the probes' tiles, plain micro 16, then the A/B rows of session 16's defaults
    items="nano hpcmeg"
    [[ $ce != default ]] && items="$items hpcmeg:env=HPCMEG_CE_LAUNCH:$ce"
    [[ $ce != default && $size != 1.3B ]] && items="$items hpcmeg:mb=16,env=HPCMEG_CE_LAUNCH:$ce"
    [[ $attn != default ]] && items="$items hpcmeg:env=HPCMEG_ATTENTION_BLOCKS:$attn"
    # micro 16 within the anchor's memory (124M, plain: 9.27 GB against 9.19): one and two layers'
    # GELU outputs recomputed in the backward, 100 MB less each (session 18: 1.308x / 1.305x at
    # 9.10 GB); 355M: backward_in_forward (1.196x at 20.98 GB against 21.75; plain micro 16 would
    # exceed it)
    [[ $size == 124M ]] && items="$items hpcmeg:mb=16 hpcmeg:mb=16,set=model.recompute_gelu_layers=1 hpcmeg:mb=16,set=model.recompute_gelu_layers=2"
    [[ $size == 355M ]] && items="$items hpcmeg:mb=16,set=$BIF"
    # the bias-dropout-add + LayerNorm forward as one Triton row pass (session 19, untimed): for
    # 1.3B's hidden 2048, where Inductor's kernel reads each row twice
    items="$items hpcmeg:set=model.layernorm_impl=triton_forward"
    user_path "$size" "$max" "$size" "$items hpcmeg:set=model.attention_backend=cudnn hpcmeg:set=model.gelu_impl=cublaslt hpcmeg:set=model.gelu_impl=triton"
}

# the LM head's backward in its forward (model.cross_entropy backward_in_forward, session 13): no
# [tokens, vocab] gradient kept, 103 MB less per sequence, so larger micro batches fit
BIF=model.cross_entropy=backward_in_forward

# lt_ok: whether cuBLASLt's GELU epilogues (the shipped gelu_impl since session 16) agree with their
# twins on this call's GPU (bench/gpu_agreement.py --parts lt writes lt_ok; ~20 s, once per call: an
# earlier call's file says nothing about this machine)
lt_ok() {
    if [[ ! -e $OUT/lt_check.log ]]; then
        mkdir -p "$OUT/lt"
        step lt_check 90 python bench/gpu_agreement.py --parts lt --out "$OUT/lt"
    fi
    [[ -e $OUT/lt/lt_ok ]]
}

[[ $# -eq 0 ]] && set -- bdaln u1.3B
for stage in "$@"; do  # every stage checked before any runs
    case $stage in
        ab124 | ab1.3B | probes | quick | ce | gemm | mlpbwd | bdaln | a1.3B | u124 | u355 | u1.3B | uall | b124 | b355 | checks | p124 | p124m16 | p355 | p1.3B | pbif | pops | loss) ;;
        *) echo "bench/lease.sh: unknown stage '$stage' (want ab124, ab1.3B, probes, quick, ce, gemm, mlpbwd, bdaln, a1.3B, u124, u355, u1.3B, uall, b124, b355, checks, p124, p124m16, p355, p1.3B, pbif, pops or loss)" >&2
           exit 2 ;;
    esac
done
echo "hpcmeg lease at commit $HPCMEG_COMMIT, budget $BUDGET s, stages: $*" | tee "$OUT/lease.log"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null | tee -a "$OUT/lease.log"
for stage in "$@"; do
    case $stage in
        ab124)  # which fused paths earn their place: each default against the path left without it (124M)
            user_path 124M 560 124M_ab "hpcmeg hpcmeg:set=model.gelu_impl=triton hpcmeg:set=model.gelu_impl=inductor \
hpcmeg:set=model.dropout_impl=native hpcmeg:set=model.layernorm_impl=inductor hpcmeg:set=model.cross_entropy=compiled \
hpcmeg:set=model.attention_backend=cudnn nano" ;;
        ab1.3B)  # the untimed candidates: attention launch variants (124M, 1.3B), then 1.3B rows
            step attention_probe_ab 150 python bench/dev/attention_probe.py --sizes 124M,1.3B --p 0.1 --no-sdpa --tag lease_ab \
                --no-agreement --fwd "default fwd_draw=1 heavy_first=1 fwd_n=32 fwd_warps=8" \
                --bwd "default heavy_first=1 dkv_m=16+dq_n=16 dkv_n=128+bwd_warps=8 bwd_stages=2"
            user_path 1.3B 450 1.3B_ab "hpcmeg hpcmeg:set=model.layernorm_impl=triton_forward hpcmeg:set=model.gelu_impl=triton" ;;
        probes)
            step attention_probe 200 python bench/dev/attention_probe.py --sizes 124M,355M,1.3B --p 0.1 --tag lease \
                --agree heavy_first=1 \
                --fwd "default heavy_first=1 fwd_draw=1 heavy_first=1+fwd_stages=4 heavy_first=1+fwd_m=128" \
                --bwd "default heavy_first=1 heavy_first=1+dkv_m=64 heavy_first=1+dq_n=64"
            step dropout_check 90 python bench/gpu_agreement.py --parts dropout --out "$OUT"
            ;;
        quick)
            step attention_probe 120 python bench/dev/attention_probe.py --sizes 124M,355M --p 0.1 --tag lease \
                --fwd "default heavy_first=1 fwd_draw=1" --bwd "default heavy_first=1" \
                --bits "bits_loop=1 bits_loop=1+bits_rows=128+bits_warps=8 bits_loop=1+bits_rows=32 bits_warps=8"
            step ce_probe 90 python bench/dev/ce_probe.py --rows 12288,4096 --out "$OUT"
            ;;
        ce) step ce_probe 100 python bench/dev/ce_probe.py --rows 12288,16384 --out "$OUT" ;;
        gemm) step gemm_probe 150 python bench/dev/gemm_probe.py --sizes "${GEMM_SIZES:-124M,355M,1.3B}" --out "$OUT" --tag lease ;;
        u124 | u355 | u1.3B)  # the shipped gelu_impl cublaslt checked against its twins on this GPU first
            lt_ok || echo "== cuBLASLt's epilogues did NOT agree with their twins here (see lt_check.log)" | tee -a "$OUT/lease.log"
            size=${stage#u}
            [[ $size == 1.3B ]] || size=${size}M
            user_path_u "$size" 520 ;;
        uall) x=${UALL_EXTRA:-}
            step user_path_all 560 python bench/user_path.py --sizes 124M,355M,1.3B --tok "$TOK" --tag lease_all \
                --budget-s $(($(left) - 60)) --items "nano hpcmeg:only=124M,mb=16,set=model.recompute_gelu_layers=1$x \
hpcmeg:only=355M,mb=16,set=$BIF$x hpcmeg:only=1.3B${x:+,set=${x#|}}" ;;
        b124) user_path 124M 480 124M_bif "nano hpcmeg hpcmeg:set=$BIF hpcmeg:mb=16,set=$BIF hpcmeg:mb=24,set=$BIF hpcmeg:mb=16" ;;
        b355) user_path 355M 520 355M_bif "nano hpcmeg hpcmeg:set=$BIF hpcmeg:mb=16,set=$BIF hpcmeg:mb=16" ;;
        checks) step gpu_agreement 300 python bench/gpu_agreement.py --parts wgrad,ltstep,model,dropout --out "$OUT" ;;
        p124) step profile_124M 180 python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_124M --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 ;;
        pops) step profile_124M_ops 180 env TORCH_LOGS=output_code python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 1 \
            --tok "$TOK" --tag lease_124M_ops --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=24 --ops --no-cudagraphs ;;
        mlpbwd) step mlp_bwd_probe 100 python bench/dev/mlp_bwd_probe.py --out "$OUT" --tag lease ;;
        bdaln) step bda_ln_check 90 python bench/gpu_agreement.py --parts bdaln --out "$OUT/bdaln" ;;
        a1.3B) step attention_probe_1.3B 120 python bench/dev/attention_probe.py --sizes 1.3B --p 0.1 --no-sdpa --tag lease_1.3B \
            --agree "fwd_n=32+dkv_m=16+dq_n=16 dkv_n=128+bwd_warps=8+fwd_draw=1" \
            --fwd "default fwd_draw=1 fwd_n=32 fwd_warps=8 fwd_m=128+fwd_warps=8+fwd_n=32 heavy_first=1" \
            --bwd "default heavy_first=1 dkv_m=16+dq_n=16 dkv_n=128+bwd_warps=8 bwd_stages=2" ;;
        p355) step profile_355M 270 python bench/profile_step.py --targets trainer --size 355M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_355M --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 ;;
        p1.3B) step profile_1.3B 270 python bench/profile_step.py --targets trainer --size 1.3B --warm 3 --active 2 \
            --tok "$TOK" --tag lease_1.3B --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.micro_batch_size=8 --set train.global_batch_size=64 ;;
        pbif) step profile_124M_bif 180 python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_124M_bif --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 --set train.micro_batch_size=16 --set model.cross_entropy=backward_in_forward ;;
        p124m16) step profile_124M_mb16 180 python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_124M_mb16 --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 --set train.micro_batch_size=16 ;;
        loss) step loss_parity 330 python bench/loss_parity.py --steps 400 --eval-interval 50 --tok "$TOK" --tag lease \
            --out "$OUT" --hpcmeg-variants default,kernels_1.3B,candidate ;;
    esac
done
echo "== done after $((SECONDS - START)) s; results in $OUT/lease.tgz" | tee -a "$OUT/lease.log"
# one file: the device tool returns at most 8 from $OUT (a call cut off before this line returns
# the loose files, up to 8 of them)
(cd "$OUT" || exit 1
 files=()
 for f in *; do [[ $f != lease.tgz ]] && files+=("$f"); done
 tar -czf lease.tgz "${files[@]}" && rm -rf "${files[@]}")
