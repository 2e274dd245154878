#!/usr/bin/env bash
# Installs Debian's `prometheus` (2.42 on Debian 12) for the dashboard test (tests/test_dashboard.py),
# which runs it on 127.0.0.1 against a live system. Idempotent: a no-op when `prometheus` is on PATH.
# Needs root (CI runs as root). The package's service is not started: Docker images ship a
# policy-rc.d that forbids it, and the test starts its own server on a free port either way.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
APT=(apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
if ! "${APT[@]}" install --no-install-recommends prometheus; then
    apt-get update -q
    "${APT[@]}" install --no-install-recommends prometheus
fi
command -v prometheus >/dev/null
