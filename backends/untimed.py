"""The harness's own calls to an engine (its version, tokenizer, served models, KV pool, counters, health):
an ``httpx.Client`` whose every answer is bounded in time and size, whatever the server does.

httpx's timeouts are per operation: a server that sends one byte just inside every read timeout, or an
endless body, held such a call (and the run) forever and filled memory. Here each call has a deadline,
:data:`DEADLINE_READS` times its read timeout from the moment it is sent to its last byte, and an answer
may hold at most :data:`MAX_ANSWER_BYTES`; past either the call fails with an ``httpx.ReadTimeout`` or
``httpx.ReadError`` saying which, as any other failed call to the engine does. The deadline is checked as
each piece of the answer arrives; before the headers are complete the wait is bounded by the read timeout
per read and by httpx's own cap on a header block. (Timed requests do not come here: backends/streaming.py.)
"""
from __future__ import annotations

import time

import httpx

#: An answer's most bytes: far above any real one (a large deployment's /metrics page is ~1 MiB).
MAX_ANSWER_BYTES = 64 << 20
#: A call's deadline, in read timeouts, from its send to its last byte.
DEADLINE_READS = 3


class _BoundedStream(httpx.SyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream, request: httpx.Request, deadline: float | None,
                 max_bytes: int):
        self._stream, self._request, self._deadline, self._max = stream, request, deadline, max_bytes

    def __iter__(self):
        got = 0
        for chunk in self._stream:
            got += len(chunk)
            if got > self._max:
                raise httpx.ReadError(f"the answer of {self._request.url.path} is over {self._max >> 20} MiB, "
                                      "more than any engine's", request=self._request)
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise httpx.ReadTimeout(f"the answer of {self._request.url.path} still came after its "
                                        f"deadline ({DEADLINE_READS} read timeouts)", request=self._request)
            yield chunk

    def close(self) -> None:
        self._stream.close()


class BoundedTransport(httpx.BaseTransport):
    """httpx's own transport with each answer bounded (:class:`_BoundedStream`)."""

    def __init__(self, max_bytes: int = MAX_ANSWER_BYTES, **transport_options):
        self._inner = httpx.HTTPTransport(**transport_options)
        self._max = max_bytes

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        read = (request.extensions.get("timeout") or {}).get("read")
        deadline = time.monotonic() + DEADLINE_READS * read if read else None
        response = self._inner.handle_request(request)
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > self._max:
            response.close()
            raise httpx.ReadError(f"the answer of {request.url.path} says it is {int(length):,} bytes, over "
                                  f"{self._max >> 20} MiB", request=request)
        if deadline is not None and time.monotonic() > deadline:
            response.close()
            raise httpx.ReadTimeout(f"the headers of {request.url.path} came after its deadline "
                                    f"({DEADLINE_READS} read timeouts)", request=request)
        response.stream = _BoundedStream(response.stream, request, deadline, self._max)
        return response

    def close(self) -> None:
        self._inner.close()


def bounded_client(timeout: float, headers: dict[str, str] | None = None, verify=True,
                   max_bytes: int = MAX_ANSWER_BYTES) -> httpx.Client:
    """A client for untimed calls: ``timeout`` per operation, a deadline of :data:`DEADLINE_READS` of them
    per call, answers of at most ``max_bytes``; ``verify`` as httpx takes it (an ``ssl.SSLContext``)."""
    return httpx.Client(timeout=timeout, headers=headers, transport=BoundedTransport(max_bytes, verify=verify))
