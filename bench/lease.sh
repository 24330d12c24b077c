#!/usr/bin/env bash
# The GPU runner: a list of bench/ tools in one call of a rented GPU machine (a `run` call has at
# most ~600 s), each step under its own timeout and all under one budget, every log and result
# packed into $OUT/lease.tgz.
#
#   bash bench/lease.sh STAGE [STAGE ...]      stages run in the order given; all are checked first
#
# Stages (the user-path rows: bench/user_path.py, `hpcmeg train recipes/codeparrot_small.yaml` in a
# subprocess against the nanoGPT anchor, dropout 0.1, seq 1024, bf16; each size's rows are one
# user_path process, so its ratios come from one call):
#   uall    at each of LEASE_SIZES (default "124M 355M 1.3B"): the anchor, hpcmeg as shipped, and the
#           size's memory trade-off row (124M: micro batch 16 with model.recompute_gelu_layers 1; 355M:
#           micro batch 16 with model.cross_entropy backward_in_forward). UALL_EXTRA (e.g.
#           "|model.attention_backend=cudnn") adds settings to every hpcmeg row. ~690 s on a warm H100
#           (see need()): the 1.3B rows are skipped when the call runs short; LEASE_SIZES=1.3B in a
#           second call on the same machine runs them.
#   u124 | u355 | u1.3B
#           one size: the anchor, hpcmeg as shipped, and the same-call A/B rows of the choices a recipe
#           still offers: cuDNN's SDPA instead of the Triton attention that 'auto' picks on Hopper, and
#           the memory trade-offs (124M: plain micro batch 16, micro 16 with recompute_gelu_layers 1,
#           micro 16 with backward_in_forward; 355M: micro 16 with backward_in_forward).
#   accept  this tree against an earlier one at each of LEASE_SIZES: the anchor, hpcmeg from this tree
#           and hpcmeg from $OLD_TREE (user_path's tree= key) with the same settings (each tree's own
#           shipped recipe, plus ACCEPT_KEYS on both rows, e.g. "mb=16,set=model.recompute_gelu_layers=1"),
#           one user_path process per size; its table gives this tree's row over the earlier one's.
#           Make the earlier tree before the call and carry it to the device:
#               mkdir -p .oldtree && git archive REF | tar -x -C .oldtree && echo REF > .oldtree/COMMIT
#           (.oldtree/ is git-ignored: the device run carries it only when named, carry [".oldtree"]).
#           The rows keep user_path's iterations (124M: 4 timed windows of 4 steps; 355M, 1.3B: 2):
#           a row's cost is its start and compilation (124M ~60 s, of which ~6 s are timed steps), so
#           fewer steps would save ~10 s of the stage and halve the steps behind a 1 % comparison.
#           On a warm H100 the nine rows need ~840 s (see need()), more than one call holds: a size
#           that cannot finish in what is left is skipped, not started. Run LEASE_SIZES="124M 355M"
#           (~440 s), then LEASE_SIZES=1.3B (~400 s) as a second call on the same machine; each
#           size's three rows always share one call, which is what its ratios need.
#   loss    loss parity with Hugging Face GPT-2 over 400 steps at 124M (bench/loss_parity.py, dropout 0):
#           the shipped defaults and backward_in_forward.
#   checks  the fused path against its plain twins on this GPU (bench/gpu_agreement.py, every part;
#           the parts that gate what the user path runs first).
#   p124 | p355 | p1.3B
#           where the user path's GPU time goes at that size (bench/profile_step.py, dropout 0.1, the
#           user path's micro and global batch, as shipped).
#   probes  the open kernel sweep and the kernels' re-check on this GPU: bench/dev/attention_probe.py
#           (the Triton attention's tiles at the three sizes' shapes, p = 0.1, against cuDNN; the
#           launch is tuned at head dim 64, 1.3B's head dim 128 was checked against few variants),
#           then bench/dev/gelu_probe.py and bench/dev/layernorm_probe.py (agreement with their
#           twins and time against Inductor's kernels) as far as the budget goes.
#   layouts every parallel layout with its ranks sharing the one GPU over gloo (bench/layouts_gpu.py: DP2 +
#           distributed optimizer, TP2, TP2 + SP, PP2, PP2 x V2, TP2 x PP2, NCCL world of one), 20 steps
#           of a 4 x 768 GPT at seq 1024 against one rank: in bf16 (with the fp32 noise floor), then in
#           fp32, each dtype one tool run under what is left of the budget (the tool skips a layout
#           that would not fit, and writes its table first). LAYOUTS_DTYPES (default "bf16 fp32") and
#           LAYOUTS (default all) choose, LAYOUTS_ARGS adds the tool's flags (e.g. "--stage all" if gloo
#           refuses a CUDA tensor the default staging passes through); a run cut short goes on with
#           LAYOUTS (the skipped ones) or LAYOUTS_DTYPES=fp32 in a second call.
#   recompute
#           activation recompute on one GPU (bench/recompute_memory.py): none, selective and full at
#           1.3B and 2.7B at seq 2048 (micro 4), peak memory and tokens/s per row (each row's JSON in
#           the log as it finishes; the table at the end). RECOMPUTE_ARGS replaces the tool's flags.
#   largest the largest size each recompute setting trains at seq 2048, micro 1 (recompute_memory.py
#           --largest: 2.7B, 3.3B, 4.1B, 5.2B in order until one runs out of memory).
# Environment: OUT (results; default /tmp/hpcmeg-lease), LEASE_BUDGET_S (default 570), TOK (GPT-2
# encoder.json + vocab.bpe; default .tok, carried to the device like .oldtree), LEASE_SIZES (uall,
# accept), OLD_TREE (default .oldtree), ACCEPT_KEYS, UALL_EXTRA, LAYOUTS_DTYPES, LAYOUTS, LAYOUTS_ARGS,
# RECOMPUTE_ARGS.
# Why one script: a lease is ~30 device-minutes with a start of minutes, and a start can be refused
# or a machine taken back without notice, so each call answers as much as it can and leaves what it
# measured on disk even when a step is cut short. Inductor's and Triton's caches (/tmp, ~/.triton)
# survive between calls on the same warm machine: in a second call the anchor's rows start 2-3x
# faster, hpcmeg's ~10 % (most of their warm-up is not cached).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/hpcmeg-lease}
TOK=${TOK:-.tok}
BUDGET=${LEASE_BUDGET_S:-570}
OLD_TREE=${OLD_TREE:-.oldtree}
SIZES=${LEASE_SIZES:-124M 355M 1.3B}
STAGES="uall u124 u355 u1.3B accept loss checks p124 p355 p1.3B probes layouts recompute largest"
BIF=model.cross_entropy=backward_in_forward  # the LM head's backward GEMMs in its forward: no [tokens, vocab] gradient kept
RG1=model.recompute_gelu_layers=1  # the first layer's GELU output recomputed in the backward (100 MB less at 124M, micro 16)
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

# need SIZE ITEMS: the seconds a user_path process with these rows takes on a warm H100 (start-up and
# the bf16 peak 15 s; per row, start and compilation included: anchor 25 / 25 / 80 s, hpcmeg 60 /
# 120 / 150 s at 124M / 355M / 1.3B; a cold machine takes up to 3x the anchor's and ~1.1x hpcmeg's)
need() {
    local size=$1 items=$2 nano hp n=0 item
    case $size in
        124M) nano=25 hp=60 ;;
        355M) nano=25 hp=120 ;;
        *) nano=80 hp=150 ;;
    esac
    for item in $items; do
        [[ $item == nano* ]] && n=$((n + nano)) || n=$((n + hp))
    done
    echo $((15 + n))
}

# user_path STAGE SIZE ITEMS: bench/user_path.py's rows ITEMS at SIZE as one step, when what is left
# of the budget covers need(); else skipped (a size cut short gives no ratio)
user_path() {
    local name="user_path_$1_$2" size=$2 items=$3 l n
    l=$(left)
    n=$(need "$size" "$items")
    if ((l < n)); then
        echo "== $name: skipped, $l s left where its rows need ~$n s; LEASE_SIZES=$size in another call" \
             "on this machine runs them" | tee -a "$OUT/lease.log"
        return 0
    fi
    step "$name" "$l" python bench/user_path.py --sizes "$size" --tok "$TOK" --tag "lease_$1_$2" \
        --budget-s $((l - 60)) --items "$items"
}

if [[ $# -eq 0 ]]; then
    echo "bench/lease.sh: name the stages to run (of: $STAGES); what each does is at the top of the script" >&2
    exit 2
fi
for stage in "$@"; do  # every stage checked before any runs
    [[ " $STAGES " == *" $stage "* ]] || {
        echo "bench/lease.sh: unknown stage '$stage' (want some of: $STAGES)" >&2
        exit 2
    }
    if [[ $stage == uall || $stage == accept ]]; then
        for size in $SIZES; do
            [[ $size == 124M || $size == 355M || $size == 1.3B ]] || {
                echo "bench/lease.sh: LEASE_SIZES holds '$size' (want some of: 124M 355M 1.3B)" >&2
                exit 2
            }
        done
    fi
    if [[ $stage == layouts ]]; then
        for dt in ${LAYOUTS_DTYPES:-bf16 fp32}; do
            [[ $dt == bf16 || $dt == fp32 ]] || {
                echo "bench/lease.sh: LAYOUTS_DTYPES holds '$dt' (want some of: bf16 fp32)" >&2
                exit 2
            }
        done
    fi
    if [[ $stage == accept && ! -f $OLD_TREE/hpcmeg/cli.py ]]; then
        echo "bench/lease.sh: accept needs the earlier tree at $OLD_TREE (OLD_TREE): mkdir -p .oldtree &&" \
             "git archive REF | tar -x -C .oldtree && echo REF > .oldtree/COMMIT, then carry it" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
export HPCMEG_COMMIT=${HPCMEG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "hpcmeg lease at commit $HPCMEG_COMMIT, budget $BUDGET s, stages: $*" | tee "$OUT/lease.log"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null | tee -a "$OUT/lease.log"
for stage in "$@"; do
    case $stage in
        uall)
            x=${UALL_EXTRA:-}
            for size in $SIZES; do
                items="nano hpcmeg${x:+:set=${x#|}}"
                [[ $size == 124M ]] && items="$items hpcmeg:mb=16,set=$RG1$x"
                [[ $size == 355M ]] && items="$items hpcmeg:mb=16,set=$BIF$x"
                user_path uall "$size" "$items"
            done ;;
        u124) user_path u 124M "nano hpcmeg hpcmeg:set=model.attention_backend=cudnn hpcmeg:mb=16 \
hpcmeg:mb=16,set=$RG1 hpcmeg:mb=16,set=$BIF" ;;
        u355) user_path u 355M "nano hpcmeg hpcmeg:set=model.attention_backend=cudnn hpcmeg:mb=16,set=$BIF" ;;
        u1.3B) user_path u 1.3B "nano hpcmeg hpcmeg:set=model.attention_backend=cudnn" ;;
        accept)
            k=${ACCEPT_KEYS:-}
            for size in $SIZES; do
                user_path accept "$size" "nano hpcmeg${k:+:$k} hpcmeg:${k:+$k,}tree=$OLD_TREE"
            done ;;
        loss) step loss_parity 330 python bench/loss_parity.py --steps 400 --eval-interval 50 --tok "$TOK" --tag lease \
            --out "$OUT" --hpcmeg-variants default,backward_in_forward ;;
        checks) step gpu_agreement 540 python bench/gpu_agreement.py --parts ops,ce,wgrad,model,attention,dropout \
            --out "$OUT" ;;
        p124) step profile_124M 180 python bench/profile_step.py --targets trainer --size 124M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_124M --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 ;;
        p355) step profile_355M 270 python bench/profile_step.py --targets trainer --size 355M --warm 3 --active 2 \
            --tok "$TOK" --tag lease_355M --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.global_batch_size=192 ;;
        p1.3B) step profile_1.3B 270 python bench/profile_step.py --targets trainer --size 1.3B --warm 3 --active 2 \
            --tok "$TOK" --tag lease_1.3B --out "$OUT" --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 \
            --set train.micro_batch_size=8 --set train.global_batch_size=64 ;;
        probes)
            step attention_probe 240 python bench/dev/attention_probe.py --sizes 124M,355M,1.3B --p 0.1 --tag lease \
                --out "$OUT" --agree "default fwd_n=32+dkv_m=16+dq_n=16" \
                --fwd "default fwd_n=32 fwd_warps=8 fwd_m=128+fwd_warps=8+fwd_n=32" \
                --bwd "default dkv_m=16+dq_n=16 dkv_n=128+bwd_warps=8 bwd_stages=2"
            step gelu_probe 90 python bench/dev/gelu_probe.py --out "$OUT" --budget 40
            step layernorm_probe 90 python bench/dev/layernorm_probe.py --out "$OUT" --budget 35 ;;
        layouts)
            for dt in ${LAYOUTS_DTYPES:-bf16 fp32}; do
                l=$(left)  # the tool's own budget ends 20 s before step()'s timeout, so its table is written
                step "layouts_$dt" "$l" python bench/layouts_gpu.py --dtype "$dt" --out "$OUT" --profile \
                    --budget-s $((l - 25)) --timeout-s 240 ${LAYOUTS:+--layouts "$LAYOUTS"} ${LAYOUTS_ARGS:-}
            done ;;
        recompute) step recompute_memory 560 python bench/recompute_memory.py --out "$OUT" --tag lease \
            ${RECOMPUTE_ARGS:---sizes 1.3B,2.7B --seq 2048 --mb 4 --accum 1 --steps 3 --warm 2} ;;
        largest) step recompute_largest 560 python bench/recompute_memory.py --out "$OUT" --tag lease_largest \
            --largest --seq 2048 --mb 1 --accum 1 --steps 2 --warm 1 ;;
    esac
done
echo "== done after $((SECONDS - START)) s; results in $OUT/lease.tgz" | tee -a "$OUT/lease.log"
# one file: the device tool returns a limited number of files from $OUT (a call cut off before this
# line returns the loose files)
(cd "$OUT" || exit 1
 files=()
 for f in *; do [[ $f != lease.tgz ]] && files+=("$f"); done
 tar -czf lease.tgz "${files[@]}" && rm -rf "${files[@]}")
