#!/usr/bin/env bash
# The device benchmarks of issues 23 and 24 as one background job on a lent two-GPU machine
# (device tool, kind nvidia-h100-x2, `carry: [".whl", ".whl2"]` from benchmarks/gpu_wheels.py),
# so no step is cut by the 10-minute limit of one device command and the checkpoint is trained
# once for all of them (a checkpoint trained again is another checkpoint: its null must be
# measured again):
#
#   bash benchmarks/gpu_campaign.sh start    # starts the steps in a process session of its own
#                                            # (it outlives the command), returns at once
#   bash benchmarks/gpu_campaign.sh wait     # waits until the steps end or WAIT_S (560) pass,
#                                            # then packs what they wrote into $OUT/campaign.tgz
#
# Call `wait` again the moment it returns, until it prints "campaign: done": the machine goes
# back after 30 s idle, and the job with it. STEPS (in order, default all): train (gpu_verify.sh
# train, MINUTES 2), null (gpu_verify.sh verify ONLY=none, NULL 16, EVAL 16, TOKENS 128), sims
# (the simulated providers on that null: every one, VERIFY_TIMEOUT 1500), stats
# (benchmarks/verify_statistics.py with TP 2 in the null: the candidate statistics on one set of
# evidence, NULL 16, EVAL 32; not in the default STEPS: ~15 min of its own), tp (gpu_tp.sh on the
# checkpoint, TRACES 48, TOKENS 128), e2e1 and e2e2 (gpu_e2e.sh on the checkpoint, scan-only
# audits of E2E_TRACES (4,000) with one GPU, then two: the several-GPU ratio). Each step's files
# go to /tmp/campaign/STEP/, its lines to /tmp/campaign/campaign.log.
set -u
C=/tmp/campaign
M=.models/py-24x2048
step_cmd() {
    case "$1" in
        train) MINUTES=${MINUTES:-2} bash benchmarks/gpu_verify.sh train ;;
        null) VERIFY_TIMEOUT=${NULL_TIMEOUT:-900} NULL=${NULL:-16} EVAL=${EVAL:-16} \
            TOKENS=${TOKENS:-128} ONLY=none bash benchmarks/gpu_verify.sh verify ;;
        sims) VERIFY_TIMEOUT=${VERIFY_TIMEOUT:-1500} REUSE_NULL=1 NULL=${NULL:-16} \
            EVAL=${EVAL:-16} TOKENS=${TOKENS:-128} bash benchmarks/gpu_verify.sh verify ;;
        stats) NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            timeout "${STATS_TIMEOUT:-1500}" python3 benchmarks/verify_statistics.py --model $M \
            --device cuda --null-prompts "${NULL:-16}" --eval-prompts "${EVAL:-32}" \
            --max-new-tokens "${TOKENS:-128}" --tp-null --save "$OUT/evidence.pkl" ;;
        tp) MODEL=$M TRACES=${TP_TRACES:-48} TOKENS=${TOKENS:-128} BENCH_TIMEOUT=1200 \
            bash benchmarks/gpu_tp.sh ;;
        e2e1 | e2e2) MODEL=$M PREPARE_TIMEOUT=300 bash benchmarks/gpu_e2e.sh prepare &&
            MODEL=$M GPUS=${1#e2e} TRACES=${E2E_TRACES:-4000} RUN_SIZE=1000 MODES=scan \
                DEADLINE=${E2E_DEADLINE:-400} bash benchmarks/gpu_e2e.sh audit ;;
        *) echo "unknown step $1"; return 2 ;;
    esac
}

run_all() {
    for s in ${STEPS:-train null sims tp e2e1 e2e2}; do
        mkdir -p "$C/$s"
        echo "$(date +%T) $s: start" >> "$C/campaign.log"
        local t0=$SECONDS
        OUT=$C/$s step_cmd "$s" > "$C/$s/step.log" 2>&1
        local rc=$?
        echo "$(date +%T) $s: exit $rc in $((SECONDS - t0)) s" >> "$C/campaign.log"
    done
    echo "$(date +%T) campaign: done" >> "$C/campaign.log"
}

case "${1:-}" in
    start)
        [ -d "$C" ] && { echo "a campaign already ran here: $C"; exit 1; }
        mkdir -p "$C"
        export -f step_cmd run_all
        export C M
        setsid nohup bash -c run_all > "$C/driver.log" 2>&1 < /dev/null &
        echo "campaign started: ${STEPS:-train null sims tp e2e1 e2e2}"
        ;;
    wait)
        [ -d "$C" ] || { echo "no campaign here (the machine was given back?)"; exit 1; }
        end=$((SECONDS + ${WAIT_S:-560}))
        while [ $SECONDS -lt $end ] && ! grep -q "campaign: done" "$C/campaign.log" 2>/dev/null; do
            sleep 5
        done
        cat "$C/campaign.log"
        for f in "$C"/*/step.log; do echo "== $f"; grep -v -i warn "$f" | tail -n 12; done
        tar czf "${OUT:-/tmp/out}/campaign.tgz" -C "$C" --exclude='*.safetensors' .
        ;;
    *) echo "usage: $0 start|wait"; exit 2 ;;
esac
