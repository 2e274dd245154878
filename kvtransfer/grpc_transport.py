"""The `grpc` transport: a client-streaming gRPC service on the receiver; no Ray needed between the
ends.

One `Push` stream carries one request: for each layer group, an encoded `KVGroupHeader` frame
followed by raw payload chunks of `chunk_bytes` (1-4 MiB; protobuf `bytes` fields and single huge
messages are 5-15x slower here). Frames use the identity serializer: the receiver only ever parses
msgpack headers and copies raw bytes into a preallocated, reused buffer, then verifies the checksum.
The stream's response is the acknowledgement; errors come back as gRPC statuses whose details name
the kvtransfer error type, which the sender raises again as that type. The sender's stream stays
open until all layers are sent, so layer groups go out while later layers are still being computed.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import grpc
import msgpack
import numpy as np

from kvtransfer import errors
from kvtransfer.base import DEFAULT_LEASE_S, KVReceiver, KVSender
from kvtransfer.buffers import BufferPool
from kvtransfer.leases import HeldRequest
from kvtransfer.wire import WIRE_VERSION, KVGroupHeader, as_bytes_view
from protocol.addresses import host_port

logger = logging.getLogger(__name__)

SERVICE = "pdserve.kvtransfer.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"
ABORT_METHOD = f"/{SERVICE}/Abort"  # unary: msgpack {version, request_id, sender_id, sender_epoch}
DEFAULT_CHUNK_BYTES = 2 << 20
_MAX_MESSAGE_BYTES = 16 << 20
_STATUS_BY_ERROR = [  # most specific first
    (errors.ChecksumError, grpc.StatusCode.DATA_LOSS),
    (errors.UnknownRequestError, grpc.StatusCode.NOT_FOUND),
    (errors.ReservationExpiredError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.TransferAbortedError, grpc.StatusCode.ABORTED),
    (errors.KVTransferError, grpc.StatusCode.FAILED_PRECONDITION),
]
_ERRORS_BY_NAME = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.KVTransferError)
}


def _status_for(error: errors.KVTransferError) -> grpc.StatusCode:
    return next(code for cls, code in _STATUS_BY_ERROR if isinstance(error, cls))


def _error_from_rpc(error: grpc.RpcError, request_id: str) -> errors.KVTransferError:
    """The receiver's typed error, rebuilt from a status whose details read "<ErrorName>:
    message"."""
    details = error.details() or ""
    name, _, message = details.partition(": ")
    cls = _ERRORS_BY_NAME.get(name)
    if cls is not None:
        return cls(message, request_id)
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.LeaseExpiredError(
            f"KV stream of request {request_id!r} ran past its lease", request_id
        )
    return errors.TransferAbortedError(
        f"KV stream of request {request_id!r} failed: {error.code().name} {details}", request_id
    )


@dataclass
class _OutgoingStream:
    request_id: str
    destination: str
    frames: "queue.Queue[Optional[tuple[bytes, object, object]]]"
    call: Optional[grpc.Future] = None


class GrpcKVSender(KVSender):
    def __init__(
        self, cache, allocator, sender_id: str, epoch: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ):
        super().__init__(cache, allocator, sender_id, epoch)
        if not 1 << 16 <= chunk_bytes <= 8 << 20:
            raise ValueError(f"chunk_bytes must be in [64 KiB, 8 MiB], got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._channels: dict[str, grpc.Channel] = {}
        self._abort_calls: set[grpc.Future] = set()

    def _channel(self, destination: str) -> grpc.Channel:
        channel = self._channels.get(destination)
        if channel is None:
            channel = grpc.insecure_channel(
                destination, options=[("grpc.max_send_message_length", _MAX_MESSAGE_BYTES)]
            )
            self._channels[destination] = channel
        return channel  # methods use identity (de)serializers: every frame is bytes

    def start(
        self,
        request_id: str,
        block_ids: Sequence[int],
        destination: Optional[str] = None,
        lease_s: float = DEFAULT_LEASE_S,
        wire: str = "none",
    ) -> None:
        if not destination:
            raise ValueError("the grpc transport needs the receiver's host:port as destination")
        held = self._hold(request_id, block_ids, lease_s, wire)
        stream = _OutgoingStream(request_id, destination, queue.Queue())
        held.transport_state = stream
        stream.call = (
            self._channel(destination)
            .stream_unary(PUSH_METHOD)
            .future(self._frames(stream), timeout=lease_s)
        )
        stream.call.add_done_callback(lambda call: self._on_done(request_id, call))

    def send_layers(self, request_id: str, layers: slice = slice(None)) -> None:
        held = self.ledger.get(request_id)
        header, data, buffer = self._export(held, layers)
        stream: _OutgoingStream = held.transport_state
        stream.frames.put((header.encode(), data, buffer))
        if self.all_layers_sent(held):
            stream.frames.put(None)  # closes the request side; the response is the ack
        return None

    def _frames(self, stream: _OutgoingStream) -> Iterator[bytes]:
        """Runs on gRPC's thread: header, then the payload in chunks; staging buffers go back to the
        pool once their last chunk has been copied into a message."""
        while True:
            item = stream.frames.get()
            if item is None:
                return
            header, data, buffer = item
            try:
                yield header
                if self.between_header_and_payload is not None:
                    self.between_header_and_payload(stream.request_id)
                view = memoryview(as_bytes_view(data))
                for offset in range(0, len(view), self.chunk_bytes):
                    yield bytes(view[offset : offset + self.chunk_bytes])
            finally:
                self._staging.release(buffer)

    def _on_done(self, request_id: str, call: grpc.Future) -> None:
        if call.cancelled():
            error = errors.TransferAbortedError(
                f"KV stream of request {request_id!r} cancelled", request_id
            )
        elif call.exception() is not None:
            error = _error_from_rpc(call.exception(), request_id)
        else:
            error = None
        self.ledger.note_done(request_id, error)

    def _drop(self, held: Optional[HeldRequest], aborted: bool) -> None:
        stream = held.transport_state if held is not None else None
        if not isinstance(stream, _OutgoingStream):
            return
        if aborted:  # explicit, so the receiver learns even if the stream never reached it
            notice = msgpack.packb(
                {
                    "version": WIRE_VERSION,
                    "request_id": held.request_id,
                    "sender_id": self.sender_id,
                    "sender_epoch": self.epoch,
                }
            )
            try:  # held until done: gRPC cancels a call whose future is garbage-collected
                notice_call = (
                    self._channel(stream.destination)
                    .unary_unary(ABORT_METHOD)
                    .future(notice, timeout=5.0)
                )
                self._abort_calls.add(notice_call)
                notice_call.add_done_callback(self._abort_calls.discard)
            except ValueError as error:  # channel already closed: the reservation expires instead
                logger.warning("could not send KV abort for request %r: %s", held.request_id, error)
        if stream.call is not None:
            stream.call.cancel()
        stream.frames.put(None)  # unblocks the frame generator if gRPC still waits on it

    def close(self) -> None:
        super().close()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


class GrpcKVReceiver(KVReceiver):
    """Serves `Push` on host:port (port 0 picks a free one; `address` reports it) until `close`."""

    def __init__(
        self,
        cache,
        allocator,
        host: str = "127.0.0.1",
        port: int = 0,
        receive_buffer_bytes: int = 0,
        max_streams: int = 4,
    ):
        super().__init__(cache, allocator)
        self._buffers = BufferPool(
            receive_buffer_bytes, count=1, pin_memory=cache.kv.device.type == "cuda"
        )
        self._contexts: dict[str, grpc.ServicerContext] = {}
        self._contexts_lock = threading.Lock()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_streams, thread_name_prefix="kv-recv"),
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)],
        )
        handlers = {
            "Push": grpc.stream_unary_rpc_method_handler(self._serve_push),
            "Abort": grpc.unary_unary_rpc_method_handler(self._serve_abort),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        self._port = self._server.add_insecure_port(host_port(host, port))
        if self._port == 0:
            raise OSError(f"KV receiver could not bind {host}:{port}")
        self._host = host
        self._server.start()

    @property
    def address(self) -> str:
        return host_port(self._host, self._port)

    def abort(self, request_id: str) -> bool:
        aborted = super().abort(request_id)
        with self._contexts_lock:
            context = self._contexts.pop(request_id, None)
        if context is not None:
            context.cancel()  # the sender's call ends CANCELLED and it frees its blocks
        return aborted

    def close(self) -> None:
        self._server.stop(grace=None)
        super().close()

    def _serve_abort(self, notice: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            fields = (
                msgpack.unpackb(notice, raw=False, strict_map_key=True)
                if len(notice) < 4096
                else None
            )
        except Exception:
            fields = None
        if (
            not isinstance(fields, dict)
            or fields.get("version") != WIRE_VERSION
            or not isinstance(fields.get("request_id"), str)
        ):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "WireFormatError: malformed KV abort notice"
            )
        request_id = fields["request_id"]
        self.fail(
            request_id,
            errors.TransferAbortedError(
                f"request {request_id!r} aborted by sender {fields.get('sender_id')!r}", request_id
            ),
            sender=(fields.get("sender_id"), fields.get("sender_epoch")),
        )
        return b""

    def _serve_push(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        request_id: Optional[str] = None
        failure: Optional[errors.KVTransferError] = None
        try:
            ready, groups = False, 0
            for frame in frames:
                header = KVGroupHeader.decode(frame, self.layout)
                if request_id is None:
                    request_id = header.request_id
                    with self._contexts_lock:
                        self._contexts[request_id] = context
                elif header.request_id != request_id:
                    raise errors.WireFormatError(
                        f"stream of request {request_id!r} carried {header.request_id!r}"
                    )
                self.check(header)
                ready = self._receive_group(frames, header)
                groups += 1
            if not ready:
                raise errors.TransferAbortedError(
                    f"KV stream of request {request_id!r} ended after {groups} layer groups, "
                    "before all layers",
                    request_id,
                )
        except errors.KVTransferError as error:
            failure = error
        except Exception as error:  # the stream broke: sender cancelled, died or timed out
            failure = errors.TransferAbortedError(
                f"KV stream of request {request_id!r} broke mid-transfer: {type(error).__name__} "
                f"{error}",
                request_id,
            )
        finally:
            if request_id is not None:
                with self._contexts_lock:
                    self._contexts.pop(request_id, None)
        if failure is None:
            return msgpack.packb({"request_id": request_id, "ready": True})
        failed_id = request_id or failure.request_id
        if failed_id is not None:
            self.fail(failed_id, failure)
        logger.warning("KV receive failed: %s", failure)
        context.abort(_status_for(failure), f"{type(failure).__name__}: {failure}")

    def _receive_group(self, frames: Iterator[bytes], header: KVGroupHeader) -> bool:
        buffer = self._buffers.acquire(header.payload_bytes)
        try:
            target = buffer.numpy()
            received = 0
            while received < header.payload_bytes:
                chunk = next(frames, None)
                if chunk is None:
                    raise errors.TransferAbortedError(
                        f"KV stream of request {header.request_id!r} ended mid-group "
                        f"({received}/{header.payload_bytes} bytes)",
                        header.request_id,
                    )
                end = received + len(chunk)
                if end > header.payload_bytes:
                    raise errors.WireFormatError(
                        f"KV payload of request {header.request_id!r} longer than its header's "
                        f"{header.payload_bytes} bytes",
                        header.request_id,
                    )
                target[received:end] = np.frombuffer(chunk, dtype=np.uint8)
                received = end
            return self.install(header, target)
        finally:
            self._buffers.release(buffer)
