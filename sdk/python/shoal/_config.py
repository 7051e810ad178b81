"""Connection settings: arguments first, then SHOAL_URL / SHOAL_API_KEY, then
the admin key file of a local `shoal serve`; TLS files from SHOAL_CA,
SHOAL_CERT and SHOAL_CERT_KEY."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

DEFAULT_URL = "http://127.0.0.1:7480"
DEFAULT_KEY_FILE = "/var/lib/shoal/admin.key"
DEFAULT_REQUEST_TIMEOUT = 60.0
DEFAULT_RETRIES = 6

try:  # single source of the version: the package metadata when installed
    from importlib.metadata import version as _dist_version

    VERSION = _dist_version("shoal")
except Exception:  # running from a source tree
    VERSION = "0.1.0"


@dataclass(frozen=True)
class ConnectionConfig:
    """Where the API is and how to call it.

    :param url: base URL of `shoal serve` (``SHOAL_URL``, default
        ``http://127.0.0.1:7480``).
    :param api_key: API key (``SHOAL_API_KEY``, else the contents of
        ``/var/lib/shoal/admin.key`` when it is readable).
    :param request_timeout: seconds to wait for a reply to one request (not
        for a command to finish: that is ``commands.run(timeout=...)``).
    :param retries: how many times an idempotent call is retried, with
        exponential back-off and jitter, after ``resource_exhausted``,
        ``unavailable`` or a lost connection.
    :param ca: for an ``https://`` URL, the CA certificate (PEM file) that
        signed the server's certificate (``SHOAL_CA``; default: the
        system's).
    :param cert: a client certificate (PEM file) to present, with
        ``cert_key`` (``SHOAL_CERT``, ``SHOAL_CERT_KEY``).
    """

    url: str = DEFAULT_URL
    api_key: Optional[str] = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    retries: int = DEFAULT_RETRIES
    ca: Optional[str] = None
    cert: Optional[str] = None
    cert_key: Optional[str] = None

    @classmethod
    def resolve(
        cls,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        request_timeout: Optional[float] = None,
        retries: Optional[int] = None,
    ) -> "ConnectionConfig":
        url = url or os.environ.get("SHOAL_URL") or DEFAULT_URL
        if not (url.startswith("http://") or url.startswith("https://")):
            from .exceptions import InvalidArgument

            raise InvalidArgument(f"Shoal URL {url!r} must look like http://HOST:PORT")
        if not api_key:
            api_key = os.environ.get("SHOAL_API_KEY") or _read_key_file()
        cert, cert_key = os.environ.get("SHOAL_CERT") or None, os.environ.get("SHOAL_CERT_KEY") or None
        if (cert is None) != (cert_key is None):
            from .exceptions import InvalidArgument

            raise InvalidArgument("a client certificate needs both SHOAL_CERT and SHOAL_CERT_KEY")
        return cls(
            url=url.rstrip("/"),
            api_key=api_key or None,
            request_timeout=DEFAULT_REQUEST_TIMEOUT if request_timeout is None else float(request_timeout),
            retries=DEFAULT_RETRIES if retries is None else int(retries),
            ca=os.environ.get("SHOAL_CA") or None,
            cert=cert,
            cert_key=cert_key,
        )

    @property
    def key(self) -> Tuple[Any, ...]:
        return (self.url, self.api_key, self.request_timeout, self.retries, self.ca, self.cert, self.cert_key)

    def ssl_context(self) -> Union[bool, ssl.SSLContext]:
        """What httpx verifies TLS with: its default, or a context that
        trusts ``ca`` and presents ``cert``."""
        if not (self.ca or self.cert):
            return True
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.cert_key)
        return ctx


def _read_key_file() -> Optional[str]:
    try:
        with open(DEFAULT_KEY_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None
