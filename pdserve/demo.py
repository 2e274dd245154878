"""`make demo`: a local 1 prefill + 1 decode system on the default model, a few concurrent chat
prompts streamed to the terminal with each request's TTFT and TPOT, then a clean stop."""

from __future__ import annotations

import asyncio
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
)


def run_demo(transport: str, dtype: str, device: str = "auto") -> int:
    from pdserve.client import PdserveClient
    from pdserve.system import ServeConfig, init_ray, new_event_loop, start_system

    # Every chat through the prefill pool and a KV handoff (the demo shows disaggregation;
    # `--pd-policy auto` would prefill these short prompts on the decode worker)
    config = ServeConfig(
        transport=transport, dtype=dtype, device=device, port=0, pd_policy="remote"
    )
    init_ray(config)  # on the main thread, where Ray can install its signal handlers
    loop = new_event_loop()
    threading.Thread(target=loop.run_forever, name="router", daemon=True).start()
    print(
        f"starting Ray, 1 prefill + 1 decode worker ({transport} KV transport, {dtype}) ...",
        flush=True,
    )
    system = asyncio.run_coroutine_threadsafe(start_system(config), loop).result(timeout=300)
    print(f"{system.ready_line()}\nsending {len(PROMPTS)} chat prompts at once\n", flush=True)
    print(f"> {PROMPTS[0]}", flush=True)  # its answer streams live
    lock = threading.Lock()

    def ask(index: int, prompt: str):
        with PdserveClient(port=system.port, timeout_s=300) as client:
            request = client.request(
                messages=[{"role": "user", "content": prompt}], max_tokens=96, temperature=0
            )
            text, last = "", None
            for response in client.stream(request):
                text += response.text
                if index == 0:  # the first answer streams live; the others print when complete
                    with lock:
                        sys.stdout.write(response.text)
                        sys.stdout.flush()
                last = response
            return prompt, text, last

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(ask, range(len(PROMPTS)), PROMPTS))
        print()
        for index, (prompt, text, last) in enumerate(results):
            t = last.timings
            if index:
                print(f"\n> {prompt}\n{text}")
            print(
                f"  [{last.usage.completion_tokens} tokens, finish {last.finish_reason}; TTFT "
                f"{t.ttft_s * 1e3:.0f} ms, TPOT {t.tpot_s * 1e3:.1f} ms, KV "
                f"{t.kv_bytes / 1e6:.2f} MB moved in {t.kv_transfer_s * 1e3:.1f} ms; prefill on "
                f"{last.prefill_worker}, decode on {last.decode_worker}]"
            )
    finally:
        asyncio.run_coroutine_threadsafe(system.stop(), loop).result(timeout=60)
        import ray

        ray.shutdown()
    return 0
