"""A long-lived exec in a sandbox, spoken to in frames: the zygote's and the episode
session's connection.

`AttachedExec.start(box, argv)` creates an exec of `argv` as the candidate's uid with stdin
attached and starts it on an upgraded Podman API connection (the socket is the exec's stdin
one way and its multiplexed stdout/stderr the other). Frames are a 4-byte big-endian length
and the bytes, both ways; stderr is kept as a short tail for error messages.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Sequence

from reinforge.envs.sandbox.box import Sandbox, SandboxInfraError, default_podman_url

_API = "/v4.0.0/libpod"


class AttachedExec:
    """The frame channel to one exec. Not thread-safe."""

    def __init__(self, sock: socket.socket, send_timeout_s: float) -> None:
        self._sock = sock
        self._send_timeout_s = send_timeout_s
        self._stdout = bytearray()
        self._stderr = bytearray()
        self._frames = bytearray()  # the multiplexed stream, not yet split

    @classmethod
    def start(cls, box: Sandbox, argv: Sequence[str]) -> AttachedExec:
        """Start `argv` in `box`. Raises OSError when the API refuses it."""
        exec_id = box.create_exec(argv, {}, attach_stdin=True)
        sock = _upgrade(box.config.podman_url or default_podman_url(), exec_id,
                        box.config.api_timeout_s)
        return cls(sock, box.config.api_timeout_s)

    @classmethod
    def handshake(
        cls, box: Sandbox, argv: Sequence[str], first: bytes, what: str
    ) -> tuple[AttachedExec, dict]:
        """Start `argv` in `box`, send it `first` and read its JSON answer. Raises
        SandboxInfraError (the box marked unhealthy) when it does not start and answer."""
        io = None
        try:
            io = cls.start(box, argv)
            io.send(first)
            return io, json.loads(io.read_frame(time.monotonic() + box.config.api_timeout_s))
        except (OSError, ValueError, EOFError, TimeoutError) as exc:
            tail = io.stderr_tail if io is not None else ""
            if io is not None:
                io.close()
            box.healthy = False
            raise SandboxInfraError(
                f"{what} in sandbox {box.name} did not start: {exc}; stderr: {tail}"
            ) from exc

    @property
    def stderr_tail(self) -> str:
        return bytes(self._stderr[-500:]).decode(errors="replace")

    def close(self) -> None:
        """Close the connection: the process reads EOF (never raises)."""
        try:
            self._sock.close()
        except OSError:
            pass

    def send(self, frame: bytes, *, raw: bytes = b"") -> None:
        """A frame to the process, and `raw` bytes after it (a check's payload)."""
        self._sock.settimeout(self._send_timeout_s)
        self._sock.sendall(struct.pack(">I", len(frame)) + frame + raw)

    def read_frame(self, deadline: float) -> bytes:
        """The next frame on stdout. TimeoutError at `deadline`, EOFError at the end."""
        while True:
            if len(self._stdout) >= 4:
                (n,) = struct.unpack(">I", self._stdout[:4])
                if len(self._stdout) >= 4 + n:
                    frame = bytes(self._stdout[4 : 4 + n])
                    del self._stdout[: 4 + n]
                    return frame
            self._fill(deadline)

    def _fill(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        self._sock.settimeout(left)
        try:
            chunk = self._sock.recv(65536)
        except TimeoutError as exc:
            raise TimeoutError("no answer in time") from exc
        if not chunk:
            raise EOFError("the exec's connection ended")
        self._frames += chunk
        while len(self._frames) >= 8:
            kind, n = self._frames[0], int.from_bytes(self._frames[4:8], "big")
            if len(self._frames) < 8 + n:
                break
            data = self._frames[8 : 8 + n]
            del self._frames[: 8 + n]
            if kind == 1:
                self._stdout += data
            else:
                self._stderr = (self._stderr + data)[-4096:]


def _upgrade(url: str, exec_id: str, timeout_s: float) -> socket.socket:
    """Start exec `exec_id` on an upgraded API connection: a socket to its stdin and output."""
    if not url.startswith("unix://"):
        raise OSError(f"an attached exec needs a local Podman socket (unix://), not {url}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(url[len("unix://") :])
        body = json.dumps({"Detach": False, "Tty": False}).encode()
        sock.sendall(
            (
                f"POST {_API}/exec/{exec_id}/start HTTP/1.1\r\nHost: podman\r\n"
                "Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)  # byte by byte: what follows the head is the stream
            if not chunk:
                raise OSError("the Podman API closed the exec connection")
            head += chunk
            if len(head) > 16384:
                raise OSError("the Podman API sent an oversized response head")
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status and b" 200 " not in status:
            raise OSError(f"the Podman API refused the exec: {head.decode(errors='replace')}")
    except BaseException:
        sock.close()
        raise
    return sock
