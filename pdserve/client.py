"""A small Python client for a running pdserve server (gRPC)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_proto import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: Optional["pb.Usage"] = None
    timings: Optional["pb.Timings"] = None
    # client clock (time.monotonic) when the first token arrived
    first_token_at_s: Optional[float] = None
    sent_at_s: float = 0.0
    decode_worker: str = ""
    prefill_worker: str = ""
    # one per token, when sampling.logprobs is set
    logprobs: list["pb.TokenLogprob"] = field(default_factory=list)
    # when sampling.prompt_logprobs is set
    prompt_logprobs: list["pb.TokenLogprob"] = field(default_factory=list)


class PdserveClient:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 50051,
        timeout_s: Optional[float] = None,
        api_key: Optional[str] = None,
        tls_ca: Optional[str] = None,
    ):
        """`api_key` (or the admin token, for admin calls) goes as `authorization: Bearer` metadata;
        `tls_ca` (a PEM root certificate file) connects with TLS."""
        address = f"{host}:{port}"
        if tls_ca is None:
            self.channel = grpc.insecure_channel(address)
        else:
            with open(tls_ca, "rb") as certificate:
                self.channel = grpc.secure_channel(
                    address, grpc.ssl_channel_credentials(certificate.read())
                )
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "PdserveClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def request(
        prompt: Optional[str] = None,
        *,
        messages: Optional[Sequence[dict]] = None,
        token_ids: Optional[Sequence[int]] = None,
        request_id: str = "",
        **sampling,
    ) -> "pb.GenerateRequest":
        request = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
        if messages is not None:
            request.chat.messages.extend(
                pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
            )
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        elif prompt is not None:
            request.text = prompt
        return request

    def stream(self, request: "pb.GenerateRequest") -> Iterator["pb.GenerateResponse"]:
        return self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)

    def generate(self, request: "pb.GenerateRequest") -> Completion:
        done = Completion(sent_at_s=time.monotonic())
        for response in self.stream(request):
            if response.token_ids and done.first_token_at_s is None:
                done.first_token_at_s = time.monotonic()
            done.request_id = response.request_id
            done.text += response.text
            done.token_ids += list(response.token_ids)
            done.logprobs += list(response.logprobs)
            done.prompt_logprobs += list(response.prompt_logprobs)
            if response.finish_reason:
                done.finish_reason = response.finish_reason
                done.usage, done.timings = response.usage, response.timings
                done.decode_worker, done.prefill_worker = (
                    response.decode_worker,
                    response.prefill_worker,
                )
        return done

    def chat(self, content: str, **sampling) -> Completion:
        return self.generate(
            self.request(messages=[{"role": "user", "content": content}], **sampling)
        )

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=10, metadata=self.metadata
        ).found

    def stats(self) -> "pb.GetStatsResponse":
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=30, metadata=self.metadata)

    def scale(
        self, prefill: Optional[int] = None, decode: Optional[int] = None, timeout_s: float = 600
    ) -> "pb.ScaleResponse":
        request = pb.ScaleRequest()
        if prefill is not None:
            request.prefill = prefill
        if decode is not None:
            request.decode = decode
        return self.stub.Scale(request, timeout=timeout_s, metadata=self.metadata)

    def is_serving(self) -> bool:
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.is_serving():
                return True
            time.sleep(0.25)
        return False
