"""Every file kvbench reads as input (a model's config.json, a GGUF's header, a workload, a tolerances file,
run.json), read with bounds: a regular file only (a FIFO, a device such as /dev/zero behind a symbolic link,
a folder or a socket is refused, and opening never blocks: ``O_NONBLOCK``, then ``fstat`` on what was
opened), at most ``max_bytes``, and for JSON and TOML at most ``max_depth`` levels of nesting. Each
violation is an :class:`InputError`, one line naming the file, which the commands turn into exit 2.

In the KV model's folder, the bottom layer, because the KV model reads configs and GGUF headers itself and
may import nothing above it; every layer above uses it from here.
"""
from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path

MiB = 1 << 20
#: Bounds by kind of file; the largest real ones are far below (a config.json of 10 KiB, a run.json of 1 MiB).
CONFIG_MAX_BYTES = 16 * MiB
RUN_JSON_MAX_BYTES = 256 * MiB
TOML_MAX_BYTES = 4 * MiB
TOKENIZER_MAX_BYTES = 128 * MiB  # the largest real tokenizer.json (Gemma 3's) is ~33 MiB
MAX_DEPTH = 64


class InputError(ValueError):
    """An input file kvbench will not read: not a regular file, too large, too deeply nested, not JSON/TOML."""


def _named(what: str, path) -> str:
    return f"{what} {path}" if what else str(path)


_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a folder"))


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words: "a file", "a FIFO", "a folder", ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | Path, what: str = "file") -> int:
    """A file descriptor of ``path`` opened for reading, when it is (or links to) a regular file. Never
    blocks: a FIFO opened with O_NONBLOCK returns at once, and is then refused by fstat. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InputError(f"{_named(what, path)}: {(exc.strerror or str(exc)).lower()}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(f"{_named(what, path)} is {file_kind(mode)}, not a regular file: kvbench reads only regular files")
    return fd


def read_bytes(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The whole of ``path`` (a regular file, :func:`open_regular`), at most ``max_bytes``."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise InputError(f"{_named(what, path)} is {size / MiB:,.1f} MiB, over the {max_bytes / MiB:,g} MiB "
                             f"kvbench reads")
        data = f.readall()  # one buffer of the file's size, as Path.read_bytes
    if len(data) > max_bytes:  # it grew while read
        raise InputError(f"{_named(what, path)} is over the {max_bytes / MiB:,g} MiB kvbench reads")
    return data


def depth(value) -> int:
    """How deeply ``value`` (parsed JSON or TOML) nests: 0 for a scalar, 1 for a flat list or object."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            level += 1
            deepest = max(deepest, level)
            stack.extend((v, level) for v in item if isinstance(v, (dict, list)))
    return deepest


def _too_deep(path, what: str, max_depth: int) -> InputError:
    return InputError(f"{_named(what, path)} nests deeper than {max_depth} levels: not a file kvbench reads")


def _check_depth(value, path, what: str, max_depth: int):
    if depth(value) > max_depth:
        raise _too_deep(path, what, max_depth)
    return value


def read_json(path: str | Path, max_bytes: int = CONFIG_MAX_BYTES, what: str = "file",
              max_depth: int = MAX_DEPTH):
    """``path`` parsed as JSON, within the bounds. Not JSON (or not UTF-8) is an InputError too."""
    return parse_json(read_bytes(path, max_bytes, what), path, what, max_depth)


def parse_json(data: bytes, path: str | Path, what: str = "file", max_depth: int = MAX_DEPTH):
    """``data`` (read from ``path``, within its own bound) parsed as JSON of at most ``max_depth`` levels."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise _too_deep(path, what, max_depth) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InputError(f"{_named(what, path)}: not valid JSON ({exc})") from None
    return _check_depth(value, path, what, max_depth)


def read_toml(path: str | Path, max_bytes: int = TOML_MAX_BYTES, what: str = "file",
              max_depth: int = MAX_DEPTH) -> dict:
    """``path`` parsed as TOML, within the bounds."""
    data = read_bytes(path, max_bytes, what)
    try:
        value = tomllib.loads(data.decode())
    except RecursionError:
        raise _too_deep(path, what, max_depth) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{_named(what, path)}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{_named(what, path)}: not valid TOML: {exc}") from None
    return _check_depth(value, path, what, max_depth)


# --- YAML ----------------------------------------------------------------------------------------------

#: nodes that aliases may add to a YAML document beyond its own (a "billion laughs" of nested aliases: 620
#: bytes that expand to 10^9 nodes, which any walk of the loaded data then visits one by one)
YAML_MAX_ALIAS_NODES = 100_000


def parse_yaml(data: bytes | str, path: str | Path, what: str = "file", max_depth: int = MAX_DEPTH,
               max_alias_nodes: int = YAML_MAX_ALIAS_NODES):
    """``data`` (read from ``path`` within its own bound) parsed as YAML of plain data (PyYAML's safe loader),
    its node graph checked before anything is built from it: at most ``max_depth`` levels and at most
    ``max_alias_nodes`` nodes more with every alias expanded than it has written out; an alias that contains
    itself is refused. Not YAML (or not UTF-8) is an InputError too."""
    import yaml

    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise InputError(f"{_named(what, path)}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_graph(node, path, what, max_depth, max_alias_nodes)
        return loader.construct_document(node)
    except RecursionError:
        raise _too_deep(path, what, max_depth) from None
    except yaml.YAMLError as exc:
        raise InputError(f"{_named(what, path)}: not valid YAML ({' '.join(str(exc).split())[:300]})") from None
    finally:
        loader.dispose()


def _check_yaml_graph(root, path, what: str, max_depth: int, max_alias_nodes: int) -> None:
    """Each node's size and depth with its aliases expanded, once per node (linear in the nodes written)."""
    def children(node):
        value = node.value
        if isinstance(value, list):
            return [c for item in value for c in (item if isinstance(item, tuple) else (item,))]
        return ()

    size: dict[int, int] = {}
    deep: dict[int, int] = {}
    open_: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            kids = children(node)
            size[key] = 1 + sum(size[id(c)] for c in kids)
            deep[key] = (1 + max((deep[id(c)] for c in kids), default=0)) if isinstance(node.value, list) else 0
            open_.discard(key)
            if deep[key] > max_depth:
                raise _too_deep(path, what, max_depth)
            if size[key] - len(size) > max_alias_nodes:
                raise InputError(f"{_named(what, path)}: its aliases expand it to {size[key]:,} nodes from "
                                 f"{len(size):,} written (an alias bomb): not a file kvbench reads")
            continue
        if key in size:
            continue
        if key in open_:
            raise InputError(f"{_named(what, path)}: an alias contains itself: not a file kvbench reads")
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node))


# --- GGUF headers ------------------------------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"
#: Far above any real model's (the embedded model: 291 tensors, ~40 keys), far below what a random or hostile
#: header would claim.
GGUF_MAX_TENSORS = 1 << 20
GGUF_MAX_KEYS = 1 << 16


def check_gguf_header(path: str | Path) -> None:
    """Nothing when ``path`` is a regular file holding a whole GGUF header: the magic, version 1-3, tensor and
    key counts within bounds, every key and tensor description within the file, and the tensor data reaching
    no further than the file (a file cut short); else InputError, before gguf's reader (numpy) maps it."""
    _gguf(path, decode=False)


def read_gguf_header(path: str | Path, skip_prefix: str = "tokenizer.ggml.",
                     keep: tuple[str, ...] = ("tokenizer.ggml.model",)) -> GGUFHeader | None:
    """A GGUF v2/v3 file's metadata and tensor descriptions, read in one checked pass without gguf's reader
    (numpy, and every one of a tokenizer's strings as an array: seconds for the embedded model): keys as gguf's
    ``ReaderField.contents()`` gives them (numbers, strings, lists), the values of keys under ``skip_prefix``
    (the vocabulary) not decoded unless named in ``keep``. None for a version 1 file (gguf's reader reads it);
    InputError for a file that is not a whole GGUF header."""
    return _gguf(path, decode=True, skip_prefix=skip_prefix, keep=keep)


class GGUFHeader:
    """What :func:`read_gguf_header` read: ``keys`` {name: value} and ``tensors`` [(name, shape, ggml type)]."""

    def __init__(self, keys: dict, tensors: list[tuple[str, tuple[int, ...], int]]):
        self.keys, self.tensors = keys, tensors


def _gguf(path, decode: bool, skip_prefix: str = "", keep: tuple[str, ...] = ()) -> GGUFHeader | None:
    fd = open_regular(path, "GGUF file")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        head = f.read(24)
        if len(head) < 24 or head[:4] != GGUF_MAGIC:
            got = "too short" if len(head) < 24 else f"starts {head[:4]!r}"
            raise InputError(f"GGUF file {path} is not a GGUF file ({got}, not the GGUF magic and header)")
        version = int.from_bytes(head[4:8], "little")
        tensors, keys = int.from_bytes(head[8:16], "little"), int.from_bytes(head[16:24], "little")
        if version not in (1, 2, 3):
            raise InputError(f"GGUF file {path}: GGUF version {version}, not 1-3 (damaged or not a GGUF file)")
        if tensors > GGUF_MAX_TENSORS or keys > GGUF_MAX_KEYS:
            raise InputError(f"GGUF file {path}: its header claims {tensors:,} tensors and {keys:,} keys "
                             f"(damaged or not a GGUF file)")
        if version == 1:  # 32-bit counts and lengths: too old to walk here; gguf's reader says what it finds
            return None
        try:
            header = _walk_gguf(f, size, tensors, keys, decode, skip_prefix, keep)
            if header is not None:  # as gguf's reader names them
                header.keys = {"GGUF.version": version, "GGUF.tensor_count": tensors, "GGUF.kv_count": keys,
                               **header.keys}
            return header
        except _Cut as exc:
            raise InputError(f"GGUF file {path} is damaged or cut short: {exc} (the file has {size:,} bytes)") from None


class _Cut(Exception):
    pass


_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # struct
_STRING, _ARRAY = 8, 9


def _walk_gguf(f, size: int, tensors: int, keys: int, decode: bool = False, skip_prefix: str = "",
               keep: tuple[str, ...] = ()) -> GGUFHeader | None:
    """Read past every key and tensor description of a GGUF v2/v3 header, checking each length against the
    file's size (_Cut says where it fails); with ``decode``, the keys' values and the tensors' descriptions.
    The file is mapped, not read: a tokenizer's 49K strings are skipped at the cost of their lengths."""
    import mmap
    import struct

    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    pos = 24
    unpack = struct.unpack_from

    def take(n: int, what: str) -> int:
        nonlocal pos
        if n > size - pos:
            raise _Cut(f"{what} of {n:,} bytes at byte {pos:,} runs past the end")
        at, pos = pos, pos + n
        return at

    def u(n: int, what: str) -> int:
        return int.from_bytes(buf[take(n, what):pos], "little")

    def value(kind: int, what: str, want: bool):
        nonlocal pos
        if kind in _SCALARS:
            at = take(_SCALARS[kind], what)
            return unpack("<" + _FORMATS[kind], buf, at)[0] if want else None
        if kind == _STRING:
            n = u(8, what)
            at = take(n, what)
            return bytes(buf[at:pos]).decode("utf-8", errors="replace") if want else None
        if kind == _ARRAY:
            item, count = u(4, what), u(8, what)
            if item in _SCALARS:
                at = take(_SCALARS[item] * count, what)
                return list(unpack(f"<{count}{_FORMATS[item]}", buf, at)) if want else None
            if item == _STRING and not want and count <= size:
                for _ in range(count):  # the vocabulary: only the lengths are read
                    if pos + 8 > size:
                        raise _Cut(f"{what} at byte {pos:,} runs past the end")
                    pos += 8 + unpack("<Q", buf, pos)[0]
                if pos > size:
                    raise _Cut(f"{what} runs past the end")
                return None
            if item in (_STRING, _ARRAY) and count <= size:
                items = [value(item, what, want) for _ in range(count)]
                return items if want else None
            raise _Cut(f"{what}: an array of {count:,} items of type {item}")
        raise _Cut(f"{what}: value type {kind} is no GGUF type")

    try:
        alignment, found, described = 32, {}, []
        for i in range(keys):
            n = u(8, f"the name of key {i + 1}")
            at = take(n, f"the name of key {i + 1}")
            name = bytes(buf[at:pos]).decode(errors="replace")
            kind = u(4, f"key {name}")
            want = decode and (not skip_prefix or not name.startswith(skip_prefix) or name in keep)
            got = value(kind, f"key {name}", want or name == "general.alignment")
            if want:
                found[name] = got
            if name == "general.alignment" and got and kind in (4, 10):
                alignment = got
        end = 0
        for i in range(tensors):
            n = u(8, f"the name of tensor {i + 1}")
            at = take(n, f"the name of tensor {i + 1}")
            name = bytes(buf[at:pos])
            dims = u(4, f"tensor {i + 1}")
            if dims > 8:
                raise _Cut(f"tensor {i + 1} has {dims} dimensions")
            shape = unpack(f"<{dims}Q", buf, take(8 * dims, f"tensor {i + 1}"))
            kind = u(4, f"tensor {i + 1}")
            end = max(end, u(8, f"tensor {i + 1}"))
            if decode:
                described.append((name.decode(errors="replace"), shape, kind))
        data_start = -(-pos // alignment) * alignment
        if tensors and data_start + end >= size:
            raise _Cut(f"its tensor data reaches byte {data_start + end:,}")
    finally:
        if size:
            buf.close()
    return GGUFHeader(found, described) if decode else None
