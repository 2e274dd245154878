"""Who may call what: API keys for the data plane, a separate admin token for admin calls.

Both frontends pass the client's `Authorization` value (HTTP header, or gRPC `authorization`
metadata) to `Credentials.check`. With nothing configured every call is allowed, which `check_bind`
permits only on a loopback address (or when told `--insecure`). With API keys but no admin token,
admin calls are refused: holding a data-plane key never grants admin rights. The admin token also
works on the data plane. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Optional

API_KEY_ENV = "PDSERVE_API_KEY"  # comma-separated keys
ADMIN_TOKEN_ENV = "PDSERVE_ADMIN_TOKEN"


class AuthError(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status = status  # 401: no or wrong credentials; 403: right key, not allowed this call
        self.code = code


@dataclass(frozen=True)
class Credentials:
    api_keys: tuple[str, ...] = ()
    admin_token: Optional[str] = None

    @property
    def configured(self) -> bool:
        return bool(self.api_keys or self.admin_token)

    def check(self, authorization: Optional[str], admin: bool) -> None:
        """Raises AuthError unless `authorization` ("Bearer KEY") may make this call."""
        if not self.configured:
            return
        token = _bearer(authorization)
        is_admin = (
            self.admin_token is not None and token is not None and _same(token, self.admin_token)
        )
        is_user = token is not None and any(_same(token, key) for key in self.api_keys)
        if admin:
            if is_admin:
                return
            if self.admin_token is None:
                raise AuthError(
                    403,
                    "admin calls are disabled: the server has API keys but no admin token "
                    f"(--admin-token or {ADMIN_TOKEN_ENV})",
                    "admin_disabled",
                )
            if is_user:
                raise AuthError(
                    403,
                    "this call needs the admin token; an API key only grants the data plane",
                    "admin_required",
                )
        elif is_admin or is_user or not self.api_keys:
            return
        if token is None:
            raise AuthError(
                401, "missing credentials: send 'Authorization: Bearer <key>'", "missing_api_key"
            )
        raise AuthError(
            401, "invalid API key" if not admin else "invalid admin token", "invalid_api_key"
        )


def _bearer(authorization: Optional[str]) -> Optional[str]:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, credentials: Credentials, insecure: bool) -> None:
    """Refuses (ValueError) to serve beyond loopback with no API key and admin token, unless told
    to."""
    if is_loopback(host) or insecure:
        return
    missing = [
        name
        for name, value in (
            ("an API key", credentials.api_keys),
            ("an admin token", credentials.admin_token),
        )
        if not value
    ]
    if missing:
        raise ValueError(
            f"refusing to serve on {host} without {' and '.join(missing)}: set "
            f"--api-key/{API_KEY_ENV} "
            f"and --admin-token/{ADMIN_TOKEN_ENV}, or pass --insecure to serve unauthenticated"
        )
