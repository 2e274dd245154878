"""`pdserve bench` as scripts/gpu_serve_check.py runs it: the same command line and code, plus each
request's server timings (the final gRPC message's `Timings`: TTFT, KV bytes and KV handoff time)
written beside the report, per rate, to `<result file>.handoff.json`.

    python scripts/gpu_serve_bench.py <pdserve bench arguments, with --result-file>

Only the public gRPC API is read (no router internals): the bench's gRPC stub is wrapped so every
final message of a completed request is noted. The bench runs its rates in turn, each to its end, so
the notes split by each rate's count of completed requests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve import bench  # noqa: E402
from pdserve.bench_backends import GrpcBackend  # noqa: E402

NOTES: list[dict] = []


class _NotingStub:
    """The Generation stub, whose Generate stream notes the final message's timings."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def Generate(self, request, **kwargs):  # noqa: N802 (the gRPC method's name)
        return _noting(self._stub.Generate(request, **kwargs))


async def _noting(stream):
    async for response in stream:
        if response.finish_reason and response.finish_reason != "abort":
            t = response.timings
            NOTES.append(
                {"kv_bytes": t.kv_bytes, "kv_transfer_s": t.kv_transfer_s, "ttft_s": t.ttft_s}
            )
        yield response


class NotingGrpcBackend(GrpcBackend):
    def __init__(self, config):
        super().__init__(config)
        self.stub = _NotingStub(self.stub)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="gpu_serve_bench")
    sub = parser.add_subparsers()
    bench.add_parser(sub)
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    bench.GrpcBackend = NotingGrpcBackend  # what run_bench constructs for --backend grpc
    code = bench.run_cli(args)
    report = json.loads(Path(args.result_file).read_text())
    per_rate, taken = [], 0
    for result in report["results"]:
        per_rate.append(NOTES[taken : taken + result["completed"]])
        taken += result["completed"]
    Path(f"{args.result_file}.handoff.json").write_text(json.dumps(per_rate))
    return code


if __name__ == "__main__":
    sys.exit(main())
