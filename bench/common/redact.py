"""Credentials out of everything kvbench shows or writes.

A URL is shown with its userinfo (``user:password@``) as ``***@`` and the values of query parameters whose
names look secret (key, token, secret, password, ...) as ``***``. :func:`redact_text` does that to every
URL inside a free text (a command line, an error message).

What a server sends back is another matter: a proxy's error page may echo the ``Authorization`` header, a
server its Basic credentials. Every credential kvbench holds is registered when the backend options are
parsed (:func:`hold_secret`, :func:`hold_userinfo`), and the hub token of the environment when a command
starts (:func:`hold_environment_tokens`); :func:`scrub` masks each in every form a server could echo (plain,
base64 standard and URL-safe, padded or not and at any offset inside a longer base64 text (a piece of
at least 8 characters), percent-encoded
with upper- or lower-case hex, JSON-escaped, HTML-escaped), and the writers, the server-text entry points and
the console (:class:`ScrubbingStream`) apply it. A form shorter than :data:`MIN_HELD` characters is not
masked in free text (a three-letter password would mask ordinary words); its base64 form still is. A load
worker process holds what its parent holds (:func:`held_values`, re-held there: ``kvbench.load.workers``).
"""
from __future__ import annotations

import base64
import contextlib
import html
import json
import os
import re
from urllib.parse import quote, quote_plus, urlsplit, urlunsplit

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


# --- credentials held by this process, masked wherever a server's text goes ------------------------------

MIN_HELD = 4
_held: set[str] = set()
_values: list[str] = []  # what was held, as given (a worker process holds the same: held_values)
_pattern: re.Pattern | None = None
_PERCENT_HEX = re.compile(r"%[0-9A-F]{2}")
#: Environment variables that hold a hub token (huggingface_hub reads them; the engines inherit them).
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def _base64_forms(data: bytes) -> set[str]:
    """``data`` in base64 (standard and URL-safe alphabets, padded and not), also where it sits inside a longer
    base64 text: at each of the three byte offsets, the characters that only ``data``'s bits decide."""
    out = set()
    for offset in range(3):
        encoded = base64.b64encode(bytes(offset) + data).decode()
        first, last = -(-offset * 8 // 6), (offset + len(data)) * 8 // 6  # characters wholly inside data
        inner = encoded[first:last]
        if offset == 0:
            out |= {encoded, encoded.rstrip("=")}
        if len(inner) >= 8:  # a shorter piece of base64 could be any text's
            out.add(inner)
    return out | {f.translate(str.maketrans("+/", "-_")) for f in out}


def _forms(value: str) -> set[str]:
    """The ways a server could echo ``value``: as is, base64 (what Basic sends, and any base64 text holding
    it), percent-encoded (a URL's userinfo; hex in either case), JSON-escaped (an error body quoting the
    header), HTML-escaped (an error page)."""
    escaped = json.dumps(value)[1:-1]
    percent = {quote(value, safe=""), quote(value), quote_plus(value)}
    percent |= {_PERCENT_HEX.sub(lambda m: m.group(0).lower(), p) for p in percent}
    html_forms = {html.escape(value), html.escape(value, quote=False)}
    html_forms |= {h.replace("&#x27;", "&#39;") for h in html_forms}
    forms = {value, escaped, escaped.replace("/", "\\/"), *percent, *html_forms, *_base64_forms(value.encode())}
    return {f for f in forms if len(f) >= MIN_HELD}


def hold_secret(value: str) -> None:
    """From now on :func:`scrub` masks ``value`` (an API key) in every form of :func:`_forms`."""
    global _pattern
    if value and not _forms(value) <= _held:
        _values.append(value)
        _held.update(_forms(value))
        # the longest first: a form inside another (the key inside "Bearer key") never leaves a tail
        _pattern = re.compile("|".join(re.escape(f) for f in sorted(_held, key=len, reverse=True)))


def hold_userinfo(user: str, password: str) -> None:
    """A URL's ``user:password@``: the password, and the pair (Basic's base64 is of the pair; percent-encoded
    as the URL had it)."""
    hold_secret(password)
    hold_secret(f"{user}:{password}")
    hold_secret(f"{quote(user, safe='')}:{quote(password, safe='')}")


def held_values() -> list[str]:
    """Every credential held, as it was given: what another process of the run (a load worker) holds too."""
    return list(_values)


def hold_environment_tokens() -> None:
    """The hub token of the environment (:data:`TOKEN_VARIABLES`, else huggingface_hub's token file), held:
    a server or an engine's log that prints it has it masked."""
    for name in TOKEN_VARIABLES:
        if value := os.environ.get(name, "").strip():
            hold_secret(value)
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                  "huggingface"), "token")
    from kvbench.kv import bounded  # the bounded reader: a token file that is a FIFO never blocks

    try:
        token = bounded.read_bytes(path, 64 * 1024, "hub token file").decode(errors="replace").strip()
    except (OSError, ValueError):  # none (the usual case), or not one kvbench reads
        return
    if token:
        hold_secret(token)


def holding() -> bool:
    return _pattern is not None


@contextlib.contextmanager
def held_within():
    """What is held on entering is what is held on leaving: credentials held inside are let go. For a process
    that runs several commands in turn (a test worker, a notebook), where one command's key would otherwise
    mask that word in every later command's output."""
    global _pattern
    held, values, pattern = set(_held), list(_values), _pattern
    try:
        yield
    finally:
        _held.clear()
        _held.update(held)
        _values[:] = values
        _pattern = pattern


def scrub(text: str) -> str:
    """``text`` with every held credential masked (``***``); as is when none is held."""
    return text if _pattern is None else _pattern.sub(MASK, text)


def scrub_value(value):
    """``value`` (str, or dicts and lists of them, as JSON holds) with every held credential masked in its
    strings and keys; the same object when nothing was masked."""
    if _pattern is None:
        return value
    if isinstance(value, str):
        return _pattern.sub(MASK, value)
    if isinstance(value, dict):
        return {scrub_value(k): scrub_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_value(v) for v in value]
    return value


class ScrubbingStream:
    """A text stream (sys.stdout, sys.stderr) that masks held credentials in what is written to it; every
    other attribute is the wrapped stream's (isatty, fileno, encoding: rich and click ask)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._stream.write(text if _pattern is None or not isinstance(text, str) else _pattern.sub(MASK, text))

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)
