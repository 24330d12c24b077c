#!/usr/bin/env bash
# The next GPU lease in one `run` call (< 600 s): the open timing questions of issue 19, in order of
# what they decide, each step under its own timeout and all under one budget, every result in $OUT.
#
#   bash bench/lease.sh [STAGE ...]        stages, run in the order given (default: probes u124):
#     probes  attention tiles (bench/attention_probe.py: heavy-first launch order and tile variants
#             against the defaults at 124M, 355M and 1.3B, p = 0.1, and cuDNN timed as the model
#             calls it; writes attention_best_<size>.txt after each size), the hidden-dropout
#             keep-mask on the GPU against its twin bit for bit and its time (bench/gpu_agreement.py
#             --parts dropout)
#     quick   the probes' short form: default tiles and heavy_first at 124M and 355M only, the keep-bits
#             kernel's launch variants (one program per row block, taller tiles, more warps), agreement
#             with the twin at the default tiles; the CE kernel's launches (bench/ce_probe.py: prefetch,
#             reversed second sweep, chunk and warps; writes ce_best.txt, which b124 then times in the
#             user path when it is not the default) (~90 s)
#     u124 | u355 | u1.3B
#             the user path (bench/user_path.py) at that size: nano, hpcmeg as shipped, (124M, where
#             memory allows it: the anchor uses 10.4 GB, hpcmeg 7.5 at micro 12 and 9.2 at 16) micro
#             batch 16 x accumulation 12, hpcmeg with Triton attention at attention_best_<size>.txt,
#             then (124M) both, as far as the budget goes (the probes' files from this call, or
#             copied into $OUT beforehand)
#     b124 | b355
#             the user path with model.cross_entropy backward_in_forward (the LM head's backward GEMMs
#             in its forward, no [tokens, vocab] gradient kept) and model.dropout_impl triton_bits (the
#             residual branches' saved masks packed 8 to a byte): 124M nano, shipped, micro 24 x 8 with
#             both (24 divides the recipe's 8-GPU plan), then with gelu_impl cublaslt (below) at micro
#             24 and 16, micro 16 as shipped otherwise, all of it with Triton attention at the probes'
#             best tiles at micro 24 and 16, (after quick) the CE probe's best launch, and last each
#             memory lever alone; 355M nano, shipped, micro 16 with both (without, micro 16 needed
#             22.0 GB against the anchor's 21.75), then with Triton attention too (never timed in the
#             355M user path; its probe put it ~2 % of the step ahead), last backward_in_forward alone.
#             Both sizes (and u355 / u1.3B) add a row with model.gelu_impl cublaslt (no GELU forward
#             pass: the GELU in fc1's GEMM epilogue; session 15's H100 call timed a first version whose
#             backward epilogue was slow) right after the micro-24 / micro-16 rows, and take it into the Triton-attention
#             row, once bench/gpu_agreement.py --parts lt (~30 s, run by the first stage that asks)
#             found cuBLASLt's epilogues agreeing with the twins
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
#     pops    which host op launches each kernel and memset of the 124M step (bench/profile_step.py --ops
#             --no-cudagraphs, global batch 24): the CUDA-graph profiles show a memset before every bias
#             GEMM and before some cuDNN calls, each followed by ~4 us of idle GPU (~0.8 % of the step);
#             its log also holds Inductor's generated code (TORCH_LOGS=output_code), which says what the
#             ~74 one-microsecond `triton_poi_fused__to_copy_1` casts per micro batch convert
#     loss    loss parity with Hugging Face over 400 steps at 124M (bench/loss_parity.py; dropout 0), the
#             shipped defaults and the candidate ones (backward_in_forward, triton_bits, gelu_impl
#             cublaslt, Triton attention), so a default changed after the lease keeps its parity
# Environment: OUT (results; default /tmp/hpcmeg-lease), LEASE_BUDGET_S (default 570), TOK (GPT-2
# encoder.json + vocab.bpe; default .tok, carried to the device as its README says), LEASE_BEST (a
# folder in the tree with an earlier call's attention_best_<size>.txt and lt_ok, for a call without
# the probes stage or the cuBLASLt check).
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

# u124 | u355 | u1.3B: the shipped defaults against the anchor, then Triton attention
best_attention() {  # best_attention SIZE: the probes' best Triton tiles (this call's, then an earlier call's)
    local attn=default d
    for d in "$OUT" "${LEASE_BEST:-}"; do
        [[ -n $d && $attn == default && -s $d/attention_best_$1.txt ]] && attn=$(cat "$d/attention_best_$1.txt")
    done
    echo "$attn"
}

user_path_u() {  # user_path_u SIZE MAX_S
    local size=$1 max=$2 attn triton
    attn=$(best_attention "$size")
    # rows in order of what they decide, so --budget-s drops the least important: the anchor, the
    # shipped defaults, (124M) micro batch 16 x 12 (session 13: 3 % faster, 9.2 GB against the
    # anchor's 10.4), Triton attention at the probe's best tiles, then (124M) both
    triton="hpcmeg:set=model.attention_backend=triton,env=HPCMEG_ATTENTION_BLOCKS:$attn"
    if [[ $size == 124M ]]; then
        user_path "$size" "$max" "$size" "nano hpcmeg hpcmeg:mb=16 $triton ${triton/hpcmeg:/hpcmeg:mb=16,}"
    else
        local items="nano hpcmeg $triton"
        lt_ok && items="$items hpcmeg:set=$LT"
        user_path "$size" "$max" "$size" "$items"
    fi
}

# the LM head's backward in its forward (model.cross_entropy backward_in_forward, session 13): no
# [tokens, vocab] gradient kept, 103 MB less per sequence, so larger micro batches fit; with the
# residual branches' dropout masks saved packed (model.dropout_impl triton_bits, session 14): 1.75 B
# less per hidden element per layer (0.4 GB at 124M micro 24, 0.7 GB at 355M micro 16)
BIF=model.cross_entropy=backward_in_forward
BITS=model.dropout_impl=triton_bits
BIF24="hpcmeg:mb=24,set=$BIF"
BIF24B="hpcmeg:mb=24,set=$BIF|$BITS"
BIF16="hpcmeg:mb=16,set=$BIF"
BIF16B="hpcmeg:mb=16,set=$BIF|$BITS"
LT=model.gelu_impl=cublaslt

# lt_ok: whether cuBLASLt's GELU epilogues agreed with their twins on this GPU (bench/gpu_agreement.py
# --parts lt writes lt_ok): this call's or an earlier one's ($LEASE_BEST), else checked now (~30 s)
lt_ok() {
    local d
    for d in "$OUT/lt" "${LEASE_BEST:-}"; do
        [[ -n $d && -e $d/lt_ok ]] && return 0
    done
    if [[ ! -e $OUT/lt_check.log ]]; then
        mkdir -p "$OUT/lt"
        step lt_check 90 python bench/gpu_agreement.py --parts lt --out "$OUT/lt"
    fi
    [[ -e $OUT/lt/lt_ok ]]
}

[[ $# -eq 0 ]] && set -- probes u124
for stage in "$@"; do  # every stage checked before any runs
    case $stage in
        probes | quick | u124 | u355 | u1.3B | b124 | b355 | checks | p124 | p124m16 | pops | loss) ;;
        *) echo "bench/lease.sh: unknown stage '$stage' (want probes, quick, u124, u355, u1.3B, b124, b355, checks, p124, p124m16, pops or loss)" >&2
           exit 2 ;;
    esac
done
echo "hpcmeg lease at commit $HPCMEG_COMMIT, budget $BUDGET s, stages: $*" | tee "$OUT/lease.log"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null | tee -a "$OUT/lease.log"
for stage in "$@"; do
    case $stage in
        probes)
            step attention_probe 200 python bench/attention_probe.py --sizes 124M,355M,1.3B --p 0.1 --tag lease \
                --agree heavy_first=1 \
                --fwd "default heavy_first=1 heavy_first=1+fwd_stages=4 heavy_first=1+fwd_m=128" \
                --bwd "default heavy_first=1 heavy_first=1+dkv_m=64 heavy_first=1+dq_n=64"
            step dropout_check 90 python bench/gpu_agreement.py --parts dropout --out "$OUT"
            ;;
        quick)
            step attention_probe 120 python bench/attention_probe.py --sizes 124M,355M --p 0.1 --tag lease \
                --fwd "default heavy_first=1" --bwd "default heavy_first=1" \
                --bits "bits_loop=1 bits_loop=1+bits_rows=128+bits_warps=8 bits_loop=1+bits_rows=32 bits_warps=8"
            step ce_probe 90 python bench/ce_probe.py --rows 12288,4096 --out "$OUT"
            ;;
        u124) user_path_u 124M 480 ;;
        u355) user_path_u 355M 520 ;;
        u1.3B) user_path_u 1.3B 520 ;;
        b124) lt="" tri="model.attention_backend=triton,env=HPCMEG_ATTENTION_BLOCKS:$(best_attention 124M)"
            lt_ok && lt="|$LT"  # no GELU forward pass (cuBLASLt epilogue), where it agreed
            # in order of what they decide (--budget-s drops the last): micro 24 with both memory
            # levers, and with the GELU epilogues; the same at micro 16 (the fallback if micro 24 goes
            # over the anchor's 10.4 GB); s13's best (micro 16); everything with Triton attention at 24
            # and 16 (its saved keep bits cost ~19 MB per sequence); the CE launch; each lever alone
            items="nano hpcmeg $BIF24B"
            [[ -n $lt ]] && items="$items $BIF24B$lt $BIF16B$lt"
            items="$items hpcmeg:mb=16 hpcmeg:mb=24,set=$BIF|$BITS$lt|$tri hpcmeg:mb=16,set=$BIF|$BITS$lt|$tri"
            ce=$(cat "$OUT/ce_best.txt" 2>/dev/null || echo default)  # the quick stage's CE launch, if it won
            [[ $ce != default ]] && items="$items $BIF24B$lt,env=HPCMEG_CE_LAUNCH:$ce"
            user_path 124M 480 124M_bif "$items $BIF24 $BIF16" ;;
        b355) items="nano hpcmeg $BIF16B" lt=""  # micro 16 with both memory levers first, the one alone last
            lt_ok && lt="|$LT" && items="$items $BIF16B$lt"
            items="$items $BIF16B$lt|model.attention_backend=triton,env=HPCMEG_ATTENTION_BLOCKS:$(best_attention 355M)"
            user_path 355M 520 355M_bif "$items $BIF16" ;;
        checks) step gpu_agreement 300 python bench/gpu_agreement.py --parts wgrad,ltstep,model,dropout --out "$OUT" ;;
        p124) step profile_124M 180 python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_124M --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 ;;
        pops) step profile_124M_ops 180 env TORCH_LOGS=output_code python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 1 \
            --tok "$TOK" --tag lease_124M_ops --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=24 --ops --no-cudagraphs ;;
        p124m16) step profile_124M_mb16 180 python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_124M_mb16 --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 --set train.micro_batch_size=16 ;;
        loss) step loss_parity 330 python bench/loss_parity.py --steps 400 --eval-interval 50 --tok "$TOK" --tag lease \
            --out "$OUT" --hpcmeg-variants default,candidate ;;
    esac
done
echo "== done after $((SECONDS - START)) s; results in $OUT/lease.tgz" | tee -a "$OUT/lease.log"
# one file: the device tool returns at most 8 from $OUT (a call cut off before this line returns
# the loose files, up to 8 of them)
(cd "$OUT" || exit 1
 files=()
 for f in *; do [[ $f != lease.tgz ]] && files+=("$f"); done
 tar -czf lease.tgz "${files[@]}" && rm -rf "${files[@]}")
