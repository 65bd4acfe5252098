"""Where the monitor's figures go: a JSONL file, TensorBoard event files, Prometheus text.

  * `JsonlWriter`: `<run_dir>/metrics/metrics.jsonl`, one JSON object per line,
    `{"t": wall-clock s, "kind": ..., ...}`. The report reads only this file.
  * `TensorBoardWriter`: scalars under `<run_dir>/metrics/tb/` (torch's SummaryWriter,
    imported on first use so that importing this module stays cheap).
  * `prometheus_text(samples)`: the Prometheus text exposition format (0.0.4) of a list
    of `Sample`s, a pure function; `serve_http` answers `GET /metrics` with it under trio.

Metric and label names are sanitised here, so callers may pass domain or figure names
as they come (`"tier_mix.math"` becomes a valid label value, `"samples/s"` a valid name).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import trio
from reinforge.core.atomic import write_atomic


# ----------------------------------------------------------------------------- JSONL


class JsonlWriter:
    """Append JSON objects, one per line, flushed after each write (a crash loses nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.lines_written = 0

    def write(self, record: dict[str, Any]) -> None:
        if "t" not in record or "kind" not in record:
            raise ValueError(f"a metrics record needs 't' and 'kind', got keys {sorted(record)}")
        self._file.write(json.dumps(_json_safe(record), separators=(",", ":")) + "\n")
        self._file.flush()
        self.lines_written += 1

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a metrics file; a torn last line (a crash mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                if f.read(1) == "":  # the last line: torn by a crash, not corrupt
                    return
                raise ValueError(f"{path}:{n}: not a JSON object ({exc})") from None
            if not isinstance(rec, dict) or "kind" not in rec or "t" not in rec:
                raise ValueError(f"{path}:{n}: a metrics record needs 't' and 'kind'")
            yield rec


def _json_safe(value: Any) -> Any:
    """NaN and infinities are not JSON: write them as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# ----------------------------------------------------------------------------- TensorBoard


class TensorBoardWriter:
    """Scalars to TensorBoard event files in `log_dir` (one writer per monitor process)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy: only when used

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=5)
        self.scalars_written = 0

    def scalar(self, tag: str, value: float, step: int, walltime: float | None = None) -> None:
        if value is None or not math.isfinite(value):
            return
        self._writer.add_scalar(_tb_tag(tag), float(value), global_step=int(step),
                                walltime=walltime)
        self.scalars_written += 1

    def scalars(self, values: dict[str, float], step: int, walltime: float | None = None) -> None:
        for tag, value in values.items():
            self.scalar(tag, value, step, walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


_TB_BAD = re.compile(r"[^A-Za-z0-9_./-]")


def _tb_tag(tag: str) -> str:
    return _TB_BAD.sub("_", tag)


# ----------------------------------------------------------------------------- Prometheus


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One Prometheus sample: `name{labels} value`, with the family's type and help."""

    name: str
    value: float
    labels: dict[str, str] = {}
    kind: str = "gauge"
    """'gauge' or 'counter' (a counter's name should end in `_total`)."""
    help: str = ""


_NAME_BAD = re.compile(r"[^a-zA-Z0-9_:]")
_LABEL_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(name: str) -> str:
    """A valid Prometheus metric name: `[a-zA-Z_:][a-zA-Z0-9_:]*`."""
    out = _NAME_BAD.sub("_", name)
    return out if out and not out[0].isdigit() else f"_{out}"


def label_name(name: str) -> str:
    out = _LABEL_BAD.sub("_", name)
    out = out if out and not out[0].isdigit() else f"_{out}"
    return out if not out.startswith("__") else out.lstrip("_") or "label"


def _label_value(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def prometheus_text(samples: Iterable[Sample]) -> str:
    """The text exposition format: samples grouped by family, `# HELP`/`# TYPE` once each.

    Families come out in first-seen order; within a family, samples keep their order.
    """
    families: dict[str, list[Sample]] = {}
    for s in samples:
        if s.kind not in ("gauge", "counter"):
            raise ValueError(f"metric {s.name}: kind must be 'gauge' or 'counter', got {s.kind!r}")
        families.setdefault(metric_name(s.name), []).append(s)
    lines: list[str] = []
    for name, group in families.items():
        first = group[0]
        if first.help:
            lines.append(f"# HELP {name} {_help_text(first.help)}")
        lines.append(f"# TYPE {name} {first.kind}")
        for s in group:
            if s.labels:
                inner = ",".join(
                    f'{label_name(k)}="{_label_value(v)}"' for k, v in sorted(s.labels.items())
                )
                lines.append(f"{name}{{{inner}}} {_number(s.value)}")
            else:
                lines.append(f"{name} {_number(s.value)}")
    return "\n".join(lines) + "\n"


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# ----------------------------------------------------------------------------- HTTP


Route = Callable[[], tuple[str, bytes]]
"""A page: returns (content type, body); called on each request."""


async def serve_http(
    routes: dict[str, Route],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A tiny HTTP/1.1 server (h11 over trio sockets) for GET on `routes`; reports its port.

    One request per connection (`Connection: close`), which is all a Prometheus scraper
    or `curl` needs. Runs until cancelled.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        task_status.started(bound)
        await trio.serve_listeners(
            lambda stream: _serve_one(stream, routes), listeners, handler_nursery=nursery
        )


async def _serve_one(stream: trio.SocketStream, routes: dict[str, Route]) -> None:
    import h11

    conn = h11.Connection(h11.SERVER)
    try:
        with trio.move_on_after(10):
            request = None
            while request is None:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    conn.receive_data(data)
                    if not data:
                        return
                elif isinstance(event, h11.Request):
                    request = event
                else:
                    return
            path = request.target.decode("ascii", "replace").split("?", 1)[0]
            route = routes.get(path)
            if request.method not in (b"GET", b"HEAD"):
                status, ctype, body = 405, "text/plain", b"only GET is served here\n"
            elif route is None:
                known = ", ".join(sorted(routes))
                status, ctype, body = 404, "text/plain", f"no page {path}; try {known}\n".encode()
            else:
                status = 200
                ctype, body = route()
            headers = [
                ("content-type", ctype),
                ("content-length", str(len(body))),
                ("connection", "close"),
            ]
            await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
            if request.method == b"GET":
                await stream.send_all(conn.send(h11.Data(data=body)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
    except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


def write_json_file(path: Path, obj: Any) -> None:
    """An indented JSON file for people and dashboards (NaN as null), written atomically."""
    write_atomic(path, json.dumps(_json_safe(obj), indent=1).encode())
