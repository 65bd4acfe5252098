"""One async HTTP client for the SGLang API subset (the endpoints engine/server.py serves),
for SGLang and the embedded `reinforge serve` alike; it runs under trio (httpx on anyio).

    async with RolloutClient("http://127.0.0.1:30000") as client:
        samples = await client.generate(input_ids=ids, sampling_params={"n": 4, ...})
        await client.update_weights_from_disk("/ckpt/v3", weight_version="3")

Errors are split by whose fault they are:
  * `RolloutServerUnavailable`: the server is unreachable, timed out, or answered 5xx (ours,
    transient: retry later);
  * `RolloutRequestError`: the server refused the request (4xx: a bad prompt or parameter).

Versions: the server reports the policy version that produced each sample as the string
`meta_info.weight_version`; `parse_weight_version` turns it into the bus's int (the server's
start-up default "default" is version 0).
"""

from __future__ import annotations

import functools
import math
import ssl
from typing import Any

import httpx
import msgspec


CLIENT_KEEP_ALIVE_S = 2.0
"""An idle pooled connection is dropped after this: well inside servers' keep-alive (5 s for
uvicorn, SGLang's, and hypercorn's default; `reinforge serve` keeps 75 s). At httpx's own 5 s
the two timers raced, and a request sent just as the server closed the connection failed with
"Server disconnected without sending a response" (seen in `reinforge eval` over 92 domains)."""


class RolloutServerUnavailable(RuntimeError):
    """The rollout server could not be reached, timed out, or failed (5xx)."""


class RolloutRequestError(ValueError):
    """The rollout server refused the request (4xx): the text says why."""


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One generated sequence, as the learner needs it."""

    text: str
    output_ids: list[int]
    logprobs: list[float]
    """Behaviour logprob of each output id (same length as output_ids)."""
    finish_reason: str
    """"stop", "length" or "abort"."""
    weight_version: str
    """The server's weight version that generated this sample."""
    prompt_tokens: int = 0
    e2e_latency_s: float = 0.0


def parse_weight_version(value: str, *, default_version: int = 0) -> int:
    """The bus's int version from the server's string (`"default"` = `default_version`)."""
    if value in ("", "default"):
        return default_version
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"rollout server reports weight_version {value!r}, which is not an integer "
            "(start it with --weight-version N, or load weights with weight_version=str(N))"
        ) from None


@functools.cache
def _tls() -> ssl.SSLContext:
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def http_client(timeout_s: float) -> httpx.AsyncClient:
    """A short-lived async HTTP client (one request or a few), cheap to make: they share
    one TLS context, whose certificate loading took 22 ms a client, more than a reward
    model's forward pass (bench/reward_model.py)."""
    return httpx.AsyncClient(timeout=timeout_s, verify=_tls())


async def served_tokenizer(http: httpx.AsyncClient, url: str) -> Any | None:
    """The tokenizer of the model a server serves (`/get_model_info`'s `tokenizer_path`),
    when that folder is on this host; None otherwise (a remote or foreign server)."""
    from pathlib import Path

    try:
        info = (await http.get(f"{url.rstrip('/')}/get_model_info")).json()
        path = Path(str(info.get("tokenizer_path") or ""))
    except Exception:  # an older or foreign server
        return None
    if not (path.is_dir() and (path / "tokenizer_config.json").exists()):
        return None
    import trio

    from reinforge.engine.tokenizer import load_tokenizer

    return await trio.to_thread.run_sync(load_tokenizer, path)


def parse_sample(item: dict[str, Any], *, where: str = "response") -> Sample:
    """One /generate result item -> Sample; raise RolloutServerUnavailable if malformed."""
    try:
        meta = item["meta_info"]
        output_ids = [int(t) for t in item["output_ids"]]
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise KeyError("meta_info.output_token_logprobs (send return_logprob: true)")
        logprobs = [float(e[0]) if e[0] is not None else math.nan for e in entries]
        if len(logprobs) != len(output_ids):
            raise ValueError(
                f"{len(logprobs)} output_token_logprobs for {len(output_ids)} output_ids"
            )
        reason = meta.get("finish_reason") or {}
        return Sample(
            text=item.get("text", ""),
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=str(reason.get("type", "")),
            weight_version=str(meta.get("weight_version", "default")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            e2e_latency_s=float(meta.get("e2e_latency", 0.0)),
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise RolloutServerUnavailable(f"malformed /generate item in {where}: {exc}") from None


class RolloutClient:
    """SGLang-API client: /generate, /model_info, /health, /update_weights_from_disk."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        """`transport`: an httpx transport to use instead of the network (tests)."""
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"rollout server url {base_url!r} must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url, verify=_tls(),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16,
                                keepalive_expiry=CLIENT_KEEP_ALIVE_S),
            transport=transport,
        )

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            resp = await self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise RolloutServerUnavailable(
                f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}"
            ) from None
        if resp.status_code >= 500:
            raise RolloutServerUnavailable(
                f"{method} {self.base_url}{path}: HTTP {resp.status_code}: {resp.text[:300]}"
            )
        if resp.status_code >= 400:
            raise RolloutRequestError(
                f"{method} {self.base_url}{path}: HTTP {resp.status_code}: {resp.text[:300]}"
            )
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            raise RolloutServerUnavailable(
                f"{method} {self.base_url}{path}: answered non-JSON: {resp.text[:200]!r}"
            ) from None

    async def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: dict[str, Any],
        rid: str | None = None,
    ) -> list[Sample]:
        """Sample `sampling_params["n"]` (default 1) sequences of one prompt, with logprobs."""
        if (input_ids is None) == (text is None):
            raise ValueError("generate: pass exactly one of input_ids and text")
        body: dict[str, Any] = {"sampling_params": sampling_params, "return_logprob": True}
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        else:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        got = await self._request("POST", "/generate", body)
        items = got if isinstance(got, list) else [got]
        n = int(sampling_params.get("n", 1))
        if len(items) != n:
            raise RolloutServerUnavailable(f"/generate returned {len(items)} items for n={n}")
        return [parse_sample(it, where=f"/generate item {i}") for i, it in enumerate(items)]

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/health")
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        """/model_info, or /get_model_info on servers older than its rename."""
        try:
            return await self._request("GET", "/model_info")
        except RolloutRequestError as exc:
            if "HTTP 404" not in str(exc):
                raise
            return await self._request("GET", "/get_model_info")

    async def weight_version(self) -> str:
        """The version the server serves now (from /model_info; /get_weight_version is gone)."""
        return str((await self.model_info()).get("weight_version", "default"))

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str) -> None:
        """Load a checkpoint directory; the server finishes running requests first."""
        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": True}
        try:
            got = await self._request("POST", "/update_weights_from_disk", body)
        except RolloutRequestError as exc:
            raise RolloutRequestError(f"loading weights {model_path}: {exc}") from None
        if not isinstance(got, dict) or not got.get("success", False):
            raise RolloutRequestError(f"loading weights {model_path} failed: {got!r}")
