"""`pdserve bench`'s backends: one streamed request over the pdserve gRPC API or an
OpenAI-compatible HTTP API, timed into a `RequestRecord` (TTFT at the first chunk with output, a gap
per later chunk), with the reply's text and what the server reports of the KV it shipped and the
prompt tokens it found cached. A prompt with `messages` goes as chat messages (gRPC `chat`, OpenAI
`messages`)."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from typing import TYPE_CHECKING, Optional

from pdserve.bench_metrics import RequestRecord

if TYPE_CHECKING:
    from pdserve.bench import BenchConfig, Prompt


class StreamClock:
    """Times one streamed request: TTFT at the first chunk, a gap per later chunk."""

    def __init__(self, run_start_s: float, prompt: Prompt):
        self.prompt = prompt
        self.run_start_s = run_start_s
        self.start_s = time.perf_counter()
        self.ttft_s: Optional[float] = None
        self.itls_s: list[float] = []
        self.tokens_seen = 0
        self._last_s = self.start_s

    def chunk(self, num_tokens: int = 0) -> None:
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.start_s
        else:
            self.itls_s.append(now - self._last_s)
        self._last_s = now
        self.tokens_seen += num_tokens

    def record(
        self,
        output_len: int,
        prompt_len: Optional[int] = None,
        error: str = "",
        kv_bytes: Optional[int] = None,
        cached_prompt_tokens: Optional[int] = None,
        reply_text: str = "",
        server_prefill_s: Optional[float] = None,
        server_decode_step_s: Optional[float] = None,
    ) -> RequestRecord:
        if not error and self.ttft_s is None:
            error = "the stream ended without output"
        return RequestRecord(
            success=not error,
            prompt_len=prompt_len or self.prompt.prompt_len,
            output_len=output_len,
            ttft_s=self.ttft_s,
            itls_s=self.itls_s,
            e2el_s=time.perf_counter() - self.start_s,
            start_s=self.start_s - self.run_start_s,
            error=error,
            kv_bytes=kv_bytes,
            cached_prompt_tokens=cached_prompt_tokens,
            reply_text=reply_text,
            server_prefill_s=server_prefill_s,
            server_decode_step_s=server_decode_step_s,
        )


class GrpcBackend:
    """`pdserve.v1.Generation/Generate`, the prompt sent as token ids or chat messages."""

    def __init__(self, config: BenchConfig):
        import grpc

        from pdserve_proto import pdserve_pb2_grpc as pb_grpc

        self.config = config
        self.model = config.model or "default"
        target = f"{config.host}:{config.resolved_port}"
        if config.tls_ca:
            with open(config.tls_ca, "rb") as certificate:
                self.channel = grpc.aio.secure_channel(
                    target, grpc.ssl_channel_credentials(certificate.read())
                )
        else:
            self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {config.api_key}"),) if config.api_key else ()

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.channel.close()

    async def send(self, prompt: Prompt, clock: StreamClock) -> RequestRecord:
        import grpc

        from pdserve_proto import pdserve_pb2 as pb

        sampling = pb.SamplingParams(max_tokens=prompt.output_len, temperature=0, ignore_eos=True)
        if prompt.messages:
            chat = pb.ChatMessages(
                messages=[
                    pb.ChatMessage(role=role, content=content) for role, content in prompt.messages
                ]
            )
            request = pb.GenerateRequest(chat=chat, sampling=sampling)
        else:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt.token_ids), sampling=sampling
            )
        final, texts = None, []
        try:
            async for response in self.stub.Generate(request, metadata=self.metadata):
                if response.token_ids:
                    clock.chunk(len(response.token_ids))
                texts.append(response.text)
                if response.finish_reason:
                    final = response
        except grpc.aio.AioRpcError as error:
            return clock.record(clock.tokens_seen, error=f"{error.code().name}: {error.details()}")
        if final is None or final.finish_reason == "abort":
            reason = (
                "the stream ended without a finish reason"
                if final is None
                else "the server aborted the request"
            )
            return clock.record(clock.tokens_seen, error=reason)
        return clock.record(
            final.usage.completion_tokens or clock.tokens_seen,
            final.usage.prompt_tokens,
            kv_bytes=final.timings.kv_bytes,
            cached_prompt_tokens=final.usage.cached_prompt_tokens,
            reply_text="".join(texts),
            # a prompt prefilled where it decodes (colocated, a local prefill) is not timed apart
            server_prefill_s=final.timings.prefill_s if final.prefill_worker else None,
            server_decode_step_s=final.timings.decode_step_s or None,
        )


class OpenAIBackend:
    """`/v1/completions` or `/v1/chat/completions`, streamed as server-sent events."""

    def __init__(self, config: BenchConfig, tokenizer):
        self.config = config
        self.chat = config.backend == "openai-chat"
        self.tokenizer = tokenizer
        self.url = config.base_url + ("/v1/chat/completions" if self.chat else "/v1/completions")
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.model = config.model or ""
        self.session = None

    async def open(self) -> None:
        import aiohttp

        # No connection limit: concurrency is the benchmark's to set (request rate,
        # --max-concurrency).
        verify = (
            ssl.create_default_context(cafile=self.config.tls_ca) if self.config.tls_ca else True
        )
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=verify),
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        if not self.model:
            url = self.config.base_url + "/v1/models"
            try:
                async with self.session.get(
                    url, headers=self.headers, timeout=aiohttp.ClientTimeout(total=30)
                ) as response:
                    if response.status != 200:
                        raise ConnectionError(
                            f"GET {url}: HTTP {response.status}: {(await response.text())[:300]}"
                        )
                    models = (await response.json()).get("data") or []
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                raise ConnectionError(f"GET {url}: {type(error).__name__}: {error}") from error
            if not models:
                raise ConnectionError(
                    f"GET {self.config.base_url}/v1/models lists no model; pass --model"
                )
            self.model = models[0]["id"]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def body(self, prompt: Prompt) -> dict:
        common = {
            "model": self.model,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if self.chat:
            messages = prompt.messages or (("user", prompt.text),)
            return {
                **common,
                "messages": [{"role": role, "content": content} for role, content in messages],
                "max_completion_tokens": prompt.output_len,
            }
        return {**common, "prompt": prompt.text, "max_tokens": prompt.output_len}

    async def send(self, prompt: Prompt, clock: StreamClock) -> RequestRecord:
        import aiohttp

        texts, usage, done = [], None, False
        try:
            async with self.session.post(
                self.url, json=self.body(prompt), headers=self.headers
            ) as response:
                if response.status != 200:
                    return clock.record(
                        0, error=f"HTTP {response.status}: {(await response.text())[:300]}"
                    )
                async for raw_line in response.content:
                    line = raw_line.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments, event names
                    payload = line.removeprefix("data:").strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    data = json.loads(payload)
                    if data.get("error"):
                        return clock.record(
                            0, error=f"error event: {json.dumps(data['error'])[:300]}"
                        )
                    for choice in data.get("choices") or []:
                        text = (
                            (choice.get("delta") or {}).get("content")
                            if self.chat
                            else choice.get("text")
                        )
                        if text:
                            clock.chunk()
                            texts.append(text)
                    usage = data.get("usage") or usage
        except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as error:
            return clock.record(0, error=f"{type(error).__name__}: {error}")
        if not done:
            return clock.record(0, error="the stream ended without data: [DONE]")
        usage, reply_text = usage or {}, "".join(texts)
        output_len = usage.get("completion_tokens") or len(
            self.tokenizer.encode(reply_text, add_special_tokens=False)
        )
        cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return clock.record(
            output_len,
            usage.get("prompt_tokens"),
            cached_prompt_tokens=cached_prompt_tokens,
            reply_text=reply_text,
        )
