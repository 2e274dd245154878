"""TLS on both APIs: the client, the OpenAI API and `pdserve bench` connect with a root certificate;
a plaintext client gets nowhere."""

import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest

from pdserve.bench import BenchConfig, sweep


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1: (certificate, key) PEM paths."""
    assert shutil.which("openssl"), (
        "the openssl command is not on PATH: it makes the test certificate"
    )
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def system(harness, certificate):
    cert, key = certificate
    running = harness.start(num_prefill=1, num_decode=1, http_port=0, tls_cert=cert, tls_key=key)
    yield running
    running.stop()


def test_grpc_needs_tls_and_works_with_it(system, certificate):
    import grpc

    from pdserve.client import PdserveClient

    with PdserveClient(port=system.port, tls_ca=certificate[0], timeout_s=120) as client:
        assert (
            len(
                client.chat(
                    "Name a colour.", max_tokens=4, temperature=0, ignore_eos=True
                ).token_ids
            )
            == 4
        )
    with PdserveClient(port=system.port, timeout_s=10) as plaintext:
        with pytest.raises(grpc.RpcError) as failure:
            plaintext.chat("Name a colour.", max_tokens=4)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


def test_http_needs_tls_and_works_with_it(system, certificate):
    port = system.system.http_port
    trusted = ssl.create_default_context(cafile=certificate[0])
    with urllib.request.urlopen(
        f"https://127.0.0.1:{port}/v1/models", context=trusted, timeout=30
    ) as response:
        assert response.status == 200 and json.loads(response.read())["data"]
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read()
    # an untrusted certificate
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(
            f"https://127.0.0.1:{port}/v1/models", context=ssl.create_default_context(), timeout=10
        )


@pytest.mark.parametrize("backend", ["grpc", "openai-chat"])
def test_bench_connects_over_tls(system, certificate, backend, tmp_path):
    port = system.port if backend == "grpc" else system.system.http_port
    result_file = tmp_path / "tls.json"
    sweep(
        BenchConfig(
            backend=backend,
            port=port,
            tls_ca=certificate[0],
            num_prompts=2,
            random_input_len=16,
            random_output_len=4,
            disable_tqdm=True,
            result_file=str(result_file),
        )
    )
    (result,) = json.loads(result_file.read_text())["results"]
    assert result["completed"] == 2 and result["failed"] == 0, result["distinct_errors"]
    assert result["total_output_tokens"] == 8
