"""Credentials out of everything kvbench shows or writes.

A URL is shown with its userinfo (``user:password@``) as ``***@`` and the values of query parameters whose
names look secret (key, token, secret, password, ...) as ``***``. :func:`redact_text` does that to every
URL inside a free text (a command line, an error message).
"""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

#: Query parameter names whose values are secrets (api_key, access_token, X-Amz-Signature, sig, ...).
SECRET_NAME = re.compile(r"key|token|secret|passw|pwd|auth|credential|signature|^sig$|session", re.IGNORECASE)
#: Backend option names that would carry a secret in the clear (config refuses them; texts mask them).
SECRET_OPTIONS = ("api_key", "apikey", "key", "token", "api_token", "access_token", "bearer", "password",
                  "passwd", "secret", "auth", "authorization", "credentials")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>,]+")  # a comma ends it: -b KEY=URL,KEY=URL
_SECRET_OPTION_IN_TEXT = re.compile(r"(?<![\w.-])(" + "|".join(SECRET_OPTIONS) + r")=[^,&\s'\"]*", re.IGNORECASE)
MASK = "***"


def redact_url(url: str) -> str:
    """``url`` without its credentials: ``https://user:pw@host/p?api_key=k&n=1`` -> ``https://***@host/p?api_key=***&n=1``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not parseable as a URL: show nothing of it rather than a secret
        return MASK
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    query = "&".join(_redact_param(p) for p in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_param(param: str) -> str:
    name, eq, _ = param.partition("=")
    return f"{name}={MASK}" if eq and SECRET_NAME.search(name) else param


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (:func:`redact_url`) and the value of every secret option
    (``api_key=...``, ``token=...``; :data:`SECRET_OPTIONS`) masked: for command lines and error messages."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return _SECRET_OPTION_IN_TEXT.sub(lambda m: f"{m.group(1)}={MASK}", text)


def host_port(url: str) -> str:
    """The ``host[:port]`` of ``url``, without any userinfo: what a label or a file name may show."""
    return urlsplit(url).netloc.rpartition("@")[2]
