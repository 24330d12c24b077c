#!/usr/bin/env bash
# The next GPU lease in one `run` call (< 600 s): the open timing questions of issue 19, in order of
# what they decide, each step under its own timeout and all under one budget, every result in $OUT.
#
#   bash bench/lease.sh [STAGE ...]        stages, run in the order given (default: probes u124):
#     probes  attention tiles (bench/attention_probe.py: the row-word / heavy-first options against the
#             defaults at 124M, 355M and 1.3B, p = 0.1, and cuDNN; writes attention_best_<size>.txt
#             after each size), the CE grid
#             (bench/ce_probe.py; writes ce_best.txt), the hidden-dropout keep-mask on the GPU against
#             its twin bit for bit and its time (bench/gpu_agreement.py --parts dropout)
#     u124 | u355 | u1.3B
#             the user path (bench/user_path.py) at that size: nano, hpcmeg as shipped, hpcmeg with
#             every untimed option (Triton attention at attention_best_<size>.txt, the CE grid of
#             ce_best.txt, dropout_impl 'fused'), then each option alone, as far as the budget goes
#             (the probes' files from this call, or copied into $OUT beforehand)
#     checks  the fused model on the GPU against the plain one and TrainStep eager / compiled / CUDA
#             graphs (bench/gpu_agreement.py --parts model,wgrad: session 11's layer ends and the
#             sunk word embedding among them)
#     p124    where the 124M user path's time goes now (bench/profile_step.py, dropout 0.1, global
#             batch 192, dropout_impl 'fused'): which kernels session 11's changes removed, what is left
#     loss    loss parity with Hugging Face over 400 steps at 124M (bench/loss_parity.py; dropout 0, so
#             it checks the default path's numerics, e.g. session 11's fused MLP-branch LayerNorm)
# Environment: OUT (results; default /tmp/hpcmeg-lease), LEASE_BUDGET_S (default 570), TOK (GPT-2
# encoder.json + vocab.bpe; default .tok, carried to the device as its README says), LEASE_BEST (a
# folder in the tree with an earlier call's ce_best.txt / attention_best_<size>.txt, for a call
# without the probes stage).
# Why one script: a lease is ~30 device-minutes with a ~3-minute start, and starts are refused or
# machines taken back without notice (session 10 lost most of its lease that way), so one call has
# to answer as much as it can and leave what it measured on disk even when a step is cut short.
set -u
cd "$(dirname "$0")/.."
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

user_path() {  # user_path SIZE MAX_S
    local size=$1 max=$2 ce=0 attn=default all items
    local d
    for d in "$OUT" "${LEASE_BEST:-}"; do  # this call's probes first, then an earlier call's
        [[ -n $d && $ce == 0 && -s $d/ce_best.txt ]] && ce=$(cat "$d/ce_best.txt")
        [[ -n $d && $attn == default && -s $d/attention_best_$size.txt ]] && attn=$(cat "$d/attention_best_$size.txt")
    done
    # rows in order of what they decide, so --budget-s drops the least important: the anchor, the
    # shipped defaults, every untimed option together, then each option alone
    all="hpcmeg:set=model.attention_backend=triton|model.dropout_impl=fused"
    all+=",env=HPCMEG_ATTENTION_BLOCKS:$attn|HPCMEG_CE_PROGRAMS_PER_SM:$ce"
    items="nano hpcmeg $all hpcmeg:set=model.dropout_impl=fused"
    items+=" hpcmeg:set=model.attention_backend=triton,env=HPCMEG_ATTENTION_BLOCKS:$attn"
    [[ $ce != 0 ]] && items+=" hpcmeg:env=HPCMEG_CE_PROGRAMS_PER_SM:$ce"
    step "user_path_$size" "$max" python bench/user_path.py --sizes "$size" --tok "$TOK" --tag "lease_$size" \
        --budget-s $(($(left) - 60)) --items "$items"
}

[[ $# -eq 0 ]] && set -- probes u124
for stage in "$@"; do  # every stage checked before any runs
    case $stage in
        probes | u124 | u355 | u1.3B | checks | p124 | loss) ;;
        *) echo "bench/lease.sh: unknown stage '$stage' (want probes, u124, u355, u1.3B, checks, p124 or loss)" >&2
           exit 2 ;;
    esac
done
echo "hpcmeg lease at commit $HPCMEG_COMMIT, budget $BUDGET s, stages: $*" | tee "$OUT/lease.log"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null | tee -a "$OUT/lease.log"
for stage in "$@"; do
    case $stage in
        probes)
            RW=row_words=1+heavy_first=1
            step attention_probe 200 python bench/attention_probe.py --sizes 124M,355M,1.3B --p 0.1 --tag lease \
                --agree "$RW" \
                --fwd "default row_words=1 $RW $RW+fwd_m=128+fwd_warps=8 $RW+fwd_m=128 $RW+fwd_stages=4" \
                --bwd "default row_words=1 $RW $RW+dkv_m=64 $RW+dq_n=64 $RW+dkv_m=64+dq_n=64 $RW+bwd_warps=8+dkv_n=128+dq_m=128"
            step ce_probe 45 python bench/ce_probe.py --rows 12288,8192 --per-sm 0,1,2,3,4,6,8 --tag lease
            step dropout_check 90 python bench/gpu_agreement.py --parts dropout --out "$OUT"
            ;;
        u124) user_path 124M 420 ;;
        u355) user_path 355M 520 ;;
        u1.3B) user_path 1.3B 520 ;;
        checks) step gpu_agreement 240 python bench/gpu_agreement.py --parts model,wgrad --out "$OUT" ;;
        p124) step profile_124M 180 python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_124M --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 --set model.dropout_impl=fused ;;
        loss) step loss_parity 240 python bench/loss_parity.py --steps 400 --eval-interval 50 --tok "$TOK" --tag lease \
            --out "$OUT" ;;
    esac
done
echo "== done after $((SECONDS - START)) s; results in $OUT" | tee -a "$OUT/lease.log"
