#!/usr/bin/env bash
# The planner's validation runs (issue #30): each system started, warmed up, measured with `pdserve
# bench` (random 512/128 at 0.5, 1 and 2 req/s, 32 prompts per rate; then the multi-turn conversation
# dataset), and stopped in turn. The simulator is then run on the same arrivals (compare.py).
#     bash benchmarks/results/planner/validate.sh OUT NAME:"pdserve serve flags" ...
# e.g. validate.sh OUT "1p1d:--prefill 1 --decode 1" "colo2:--mode colocated --decode 2" \
#          "2p2d:--prefill 2 --decode 2"
set -euo pipefail
OUT=$1; shift
PY=${PY:-.venv/bin/python}
PORT=${PORT:-50771}
RATES=${RATES:-0.5,1,2}
SEED=${SEED:-11}
GOODPUT=${GOODPUT:-"ttft:1000 tpot:50"}  # the SLO the client counts goodput at
CONVERSATION=${CONVERSATION:-"--users 8 --turns 4 --system-prompt-len 256 --turn-input-len 64 --random-output-len 64 --think-time-s 2 --request-rate 0.5 --seed 7"}
mkdir -p "$OUT"
{
    echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- runtime engine router prefill_worker decode_worker kvtransfer || echo ' (+ uncommitted changes)')"
    echo "date $(date -u +%FT%TZ)"
    echo "cpu $(lscpu | sed -n 's/^Model name: *//p')"
    "$PY" -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"
    git diff --stat HEAD -- runtime engine router prefill_worker decode_worker kvtransfer protocol
} > "$OUT/machine-$(date -u +%H%M%S).txt"

for system in "$@"; do
    name=${system%%:*}; flags=${system#*:}
    # shellcheck disable=SC2086
    "$PY" -m pdserve.cli serve --port "$PORT" $flags > "$OUT/$name.serve.log" 2>&1 &
    server=$!
    trap 'kill -TERM "$server" 2>/dev/null || true' EXIT
    "$PY" -c "import sys; from pdserve.client import PdserveClient; sys.exit(not PdserveClient('127.0.0.1', $PORT).wait_ready(300))"
    "$PY" -m pdserve.cli bench --backend grpc --port "$PORT" --num-prompts 2 --random-input-len 512 \
        --random-output-len 16 --seed 99 --disable-tqdm > /dev/null
    # shellcheck disable=SC2086
    "$PY" -m pdserve.cli bench --backend grpc --port "$PORT" --dataset random --random-input-len 512 \
        --random-output-len 128 --num-prompts 32 --request-rate "$RATES" --seed "$SEED" \
        --metric-percentiles 50,90,99 --goodput $GOODPUT --disable-tqdm \
        --save-result --result-file "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    if [ -n "$CONVERSATION" ]; then
        # shellcheck disable=SC2086
        "$PY" -m pdserve.cli bench --backend grpc --port "$PORT" --dataset conversation $CONVERSATION \
            --metric-percentiles 50,90,99 --goodput $GOODPUT --disable-tqdm \
            --save-result --result-file "$OUT/$name-conversation.json" > "$OUT/$name-conversation.txt" 2>&1
    fi
    kill -TERM "$server"; wait "$server" || true
    trap - EXIT
    grep -E "Request goodput|Median TTFT|Median TPOT" "$OUT/$name.txt" | sed "s/^/$name: /" || true
done
