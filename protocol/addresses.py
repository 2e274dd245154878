"""Addresses as pdserve writes them."""

from __future__ import annotations


def host_port(host: str, port: int) -> str:
    """A bindable or dialable address: an IPv6 host goes in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
