"""The on-disk form of a stored graph: the key's stable text, its digest (the file name) and the file's bytes.

`stable_repr` gives a key a deterministic, process-independent text and `key_digest` (its sha256)
names the file. `_decode` returns a file's payload only when the stored key text and env match
exactly and the payload checksum verifies; otherwise it says whether the file is corrupt or a
mismatch (`fused_attn.graph_store.GraphStore` warns and rebuilds either way).

File `<sha256(stable_repr(key))>.graph`, little-endian::

    offset 0    8 bytes   magic b"FAGRAPH\\0"
    offset 8    uint32    FORMAT_VERSION
    offset 12   uint32    H, the header length in bytes
    offset 16   H bytes   UTF-8 JSON {"key": <stable key text>, "env": {str: str},
                                      "payload_bytes": N, "sha256": <hex of the payload>}
    offset 16+H N bytes   payload; the file is exactly 16 + H + N bytes
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import struct
from typing import Any, Dict, Hashable, List, Mapping, Optional, Tuple

__all__ = ["stable_repr", "key_digest", "FORMAT_VERSION"]

FORMAT_VERSION = 1
MAGIC = b"FAGRAPH\0"
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
_SUFFIX = ".graph"
_TMP_SUFFIX = ".tmp"


# stable key text --------------------------------------------------------------------------

def stable_repr(obj: Any) -> str:
    """Deterministic, process-independent text of a key, for digests and file headers.

    Accepted, nested freely: tuple -> "(a,b)"; None; bool -> True/False; int -> "int:5";
    float -> "float:" + float.hex (0.0 and -0.0 differ, every NaN is "float:nan");
    str -> "str:" + JSON string; enum member -> "enum:module.Qualname.NAME"; frozen dataclass
    instance -> "dc:module.Qualname(field=...,...)" over its fields with compare=True (so cached
    hashes such as GraphKey._hash, which vary per process, are left out).
    Anything else (lists, dicts, sets, arbitrary objects whose repr may hold an address, mutable
    dataclasses) raises TypeError naming the type and its position in the key.
    """
    parts: List[str] = []
    _emit(obj, parts, "key")
    return "".join(parts)


def _emit(obj: Any, out: List[str], where: str) -> None:
    if obj is None or obj is True or obj is False:
        out.append(repr(obj))
    elif isinstance(obj, enum.Enum):  # before int / str: IntEnum, StrEnum
        cls = type(obj)
        out.append(f"enum:{cls.__module__}.{cls.__qualname__}.{obj.name}")
    elif isinstance(obj, int):
        out.append(f"int:{int(obj)}")
    elif isinstance(obj, float):
        out.append(f"float:{float(obj).hex()}")
    elif isinstance(obj, str):
        out.append("str:" + json.dumps(str(obj), ensure_ascii=True))
    elif isinstance(obj, tuple):
        out.append("(")
        for i, item in enumerate(obj):
            if i:
                out.append(",")
            _emit(item, out, f"{where}[{i}]")
        out.append(")")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"stable_repr: {where} is a mutable dataclass {cls.__qualname__}; only frozen "
                            "dataclasses can be stored keys")
        out.append(f"dc:{cls.__module__}.{cls.__qualname__}(")
        first = True
        for f in dataclasses.fields(obj):
            if not f.compare:
                continue
            if not first:
                out.append(",")
            first = False
            out.append(f"{f.name}=")
            _emit(getattr(obj, f.name), out, f"{where}.{f.name}")
        out.append(")")
    else:
        raise TypeError(
            f"stable_repr: {where} has type {type(obj).__qualname__} ({obj!r:.80}), which has no "
            "process-independent text; keys may hold tuples, frozen dataclasses, str, int, float, "
            "bool, None and enum members"
        )


def key_digest(key: Hashable) -> str:
    """sha256 hex digest of `stable_repr(key)` (the stored file's name, less the suffix)."""
    return hashlib.sha256(stable_repr(key).encode("utf-8")).hexdigest()


# file format ------------------------------------------------------------------------------

def _check_env(env: Mapping[str, str]) -> Dict[str, str]:
    if not isinstance(env, Mapping):
        raise TypeError(f"GraphStore: env must be a mapping of str to str, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"GraphStore: env must map str to str, got {k!r}: {v!r}")
    return dict(sorted(env.items()))


def _encode(key_text: str, env: Dict[str, str], payload: bytes) -> bytes:
    header = json.dumps({"key": key_text, "env": env, "payload_bytes": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}, sort_keys=True).encode("utf-8")
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload


def _decode(blob: bytes, key_text: str, env: Dict[str, str]) -> Tuple[Optional[bytes], str, str]:
    """(payload, "", "") if `blob` is a valid file for key/env, else (None, kind, why) with kind
    "corrupt" or "mismatch"."""
    if len(blob) < _PREFIX.size:
        return None, "corrupt", f"truncated: {len(blob)} bytes, shorter than the {_PREFIX.size}-byte prefix"
    magic, version, header_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        return None, "corrupt", f"bad magic {magic!r}"
    if version != FORMAT_VERSION:
        return None, "mismatch", f"format version {version}, this library reads {FORMAT_VERSION}"
    end = _PREFIX.size + header_len
    if end > len(blob):
        return None, "corrupt", f"truncated header ({len(blob) - _PREFIX.size} of {header_len} bytes)"
    try:
        header = json.loads(blob[_PREFIX.size:end].decode("utf-8"))
        stored_key, stored_env = header["key"], header["env"]
        size, checksum = header["payload_bytes"], header["sha256"]
        if not (isinstance(stored_key, str) and isinstance(stored_env, dict) and isinstance(checksum, str)
                and isinstance(size, int) and not isinstance(size, bool)):
            raise TypeError("header field types")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
        return None, "corrupt", f"unreadable header ({type(exc).__name__})"
    if stored_key != key_text:
        return None, "mismatch", "holds another key (digest collision or edited file)"
    if stored_env != env:
        return None, "mismatch", "environment differs: " + _env_diff(stored_env, env)
    if len(blob) - end != size:
        return None, "corrupt", f"payload is {len(blob) - end} bytes, header says {size} (truncated or padded)"
    payload = blob[end:]
    if hashlib.sha256(payload).hexdigest() != checksum:
        return None, "corrupt", "payload checksum mismatch"
    return payload, "", ""


def _env_diff(stored: Dict[str, Any], current: Dict[str, str]) -> str:
    diffs = [f"{k} stored {stored.get(k, '<absent>')!r}, now {current.get(k, '<absent>')!r}"
             for k in sorted(set(stored) | set(current)) if stored.get(k, None) != current.get(k, None)]
    return "; ".join(diffs)


def _is_store_file(name: str) -> bool:
    stem = name[:-len(_SUFFIX)]
    return name.endswith(_SUFFIX) and len(stem) == 64 and all(c in "0123456789abcdef" for c in stem)


def _is_temp_file(name: str) -> bool:
    return name.startswith(".") and name.endswith(_TMP_SUFFIX) and _is_store_file(name[1:].split(".", 1)[0] + _SUFFIX)

