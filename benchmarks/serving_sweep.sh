#!/usr/bin/env bash
# The headline serving experiment (issue #6): the same client (`pdserve bench`, OpenAI chat API) and the
# same workload, random 512 in / 128 out, at a sweep of request rates, against
#   (a) pdserve disaggregated: 1 prefill + 1 decode worker, one core each;
#   (b) pdserve colocated: 2 workers, one core each.
# Each system is started, measured and stopped in turn. Results: OUT/{disaggregated,colocated}.{json,png,log}.
#     bash benchmarks/serving_sweep.sh [OUT] [RATES] [NUM_PROMPTS]
set -euo pipefail
OUT="${1:-benchmarks/results}"
RATES="${2:-0.5,1,2,4}"
NUM_PROMPTS="${3:-40}"
PY=.venv/bin/python
mkdir -p "$OUT"

run_system() {
    local name="$1"; shift
    local port=18000
    "$PY" -m pdserve.cli serve --dtype bfloat16 --port 0 --http-port "$port" "$@" >"$OUT/$name.log" 2>&1 &
    local server=$!
    for _ in $(seq 1 180); do
        if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then break; fi
        sleep 1
    done
    # a short warm-up, not recorded
    "$PY" -m pdserve.cli bench --backend openai-chat --port "$port" --num-prompts 4 --random-input-len 512 \
        --random-output-len 16 --seed 999 --disable-tqdm >/dev/null
    "$PY" -m pdserve.cli bench --backend openai-chat --port "$port" --num-prompts "$NUM_PROMPTS" \
        --random-input-len 512 --random-output-len 128 --request-rate "$RATES" --seed 1 \
        --goodput ttft:1000 tpot:50 --metric-percentiles 50,99 --percentile-metrics ttft,tpot,itl,e2el \
        --result-file "$OUT/$name.json" --plot "$OUT/$name.png" --disable-tqdm | tee "$OUT/$name.txt"
    kill -TERM "$server"
    wait "$server" || true
}

run_system disaggregated --mode disaggregated --prefill 1 --decode 1
run_system colocated --mode colocated --decode 2
