"""The message log on disk: a run's stored messages as framed records.

File format: the magic line ``RFLOG1\\n``, then records, each a 4-byte big-endian
length followed by a msgpack `LogRecord`. Payloads are kept as the bytes that were on
the bus, so a log replays exactly what the actors saw, malformed messages included.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec

MAGIC = b"RFLOG1\n"
_LEN = struct.Struct(">I")


class LogRecord(msgspec.Struct, frozen=True, kw_only=True):
    subject: str
    headers: dict[str, str] = {}
    stream_seq: int = 0
    timestamp: float = 0.0
    payload: bytes = b""

    @property
    def msg_id(self) -> str:
        return self.headers.get("Nats-Msg-Id", "")


class LogFormatError(ValueError):
    pass


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(LogRecord)


class LogWriter:
    def __init__(self, path: Path) -> None:
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(MAGIC)
        self.count = 0

    def write(self, record: LogRecord) -> None:
        data = _enc.encode(record)
        self._f.write(_LEN.pack(len(data)))
        self._f.write(data)
        self.count += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_log(path: str | Path) -> Iterator[LogRecord]:
    """Every record of a log file; a truncated or foreign file is a LogFormatError."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise LogFormatError(f"{path} is not a reinforge message log (bad magic)")
        index = 0
        while True:
            head = f.read(_LEN.size)
            if not head:
                return
            if len(head) < _LEN.size:
                raise LogFormatError(f"{path}: truncated length at record {index}")
            (n,) = _LEN.unpack(head)
            data = f.read(n)
            if len(data) < n:
                raise LogFormatError(f"{path}: truncated record {index}")
            try:
                yield _dec.decode(data)
            except msgspec.DecodeError as exc:
                raise LogFormatError(f"{path}: record {index}: {exc}") from None
            index += 1


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` is one token, a trailing `>` is one or more."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)
