"""The run browser: an overview per domain, the rollouts with filters, one rollout with the
verifier's checks, a task's groups across versions, and the dead letters.

Safe by default:
  * it binds to loopback and every page needs the token printed at start (`?token=...`,
    then a cookie), like Jupyter;
  * it only reads (no route changes anything);
  * every piece of run data is untrusted text (completions are the policy's, prompts may be
    users'): it goes through `html.escape` and nowhere else, and the pages carry no script
    of their own, under a Content-Security-Policy that forbids scripts altogether.
"""

from __future__ import annotations

import html
import secrets
from collections import defaultdict
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from reinforge.core.messages import ScoredRollout
from reinforge.envs.tools import decode_transcript
from reinforge.ui.runlog import RunLog

COOKIE = "reinforge_ui_token"
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'"
STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:70em}"
         "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em}"
         "pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap}.env{color:#777}")


def e(value: Any) -> str:
    """The one way run data enters a page."""
    return html.escape(str(value), quote=True)


def page(title: str, body: str) -> HTMLResponse:
    nav = ('<p><a href="/">overview</a> · <a href="/rollouts">rollouts</a> · '
           '<a href="/dlq">dead letters</a></p>')
    doc = (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
           f"<style>{STYLE}</style></head><body>{nav}<h1>{e(title)}</h1>{body}</body></html>")
    return HTMLResponse(doc, headers={"Content-Security-Policy": CSP,
                                      "X-Content-Type-Options": "nosniff"})


def rollout_rows(items: list[ScoredRollout]) -> str:
    rows = "".join(
        f"<tr><td><a href='/rollout?{urlencode({'id': s.rollout.rollout_id})}'>"
        f"{e(s.rollout.rollout_id)}</a></td><td>{e(s.rollout.domain)}</td>"
        f"<td>{e(s.rollout.tier)}</td><td>v{e(s.rollout.policy_version)}</td>"
        f"<td>{s.reward:.3f}</td><td>{e(s.outcome.value)}</td><td>{e(s.reason)}</td></tr>"
        for s in items)
    return ("<table><tr><th>rollout</th><th>domain</th><th>tier</th><th>version</th>"
            f"<th>reward</th><th>outcome</th><th>reason</th></tr>{rows}</table>")


def build_app(log: RunLog, token: str) -> Starlette:
    async def overview(request: Request) -> Response:
        per: dict[str, list[ScoredRollout]] = defaultdict(list)
        for s in log.scored:
            per[s.rollout.domain].append(s)
        rows = "".join(
            f"<tr><td><a href='/rollouts?{urlencode({'domain': d})}'>{e(d)}</a></td>"
            f"<td>{len(ss)}</td><td>{sum(s.reward for s in ss) / len(ss):.3f}</td>"
            f"<td>{sum(s.outcome.value == 'pass' for s in ss) / len(ss):.3f}</td>"
            f"<td>v{min(s.rollout.policy_version for s in ss)}–"
            f"v{max(s.rollout.policy_version for s in ss)}</td></tr>"
            for d, ss in sorted(per.items()))
        body = ("<table><tr><th>domain</th><th>rollouts</th><th>mean reward</th>"
                f"<th>pass rate</th><th>versions</th></tr>{rows}</table>"
                f"<p>{len(log.dead_letters)} dead letters; {log.undecodable} records that "
                "did not decode.</p>")
        return page("run overview", body)

    async def rollouts(request: Request) -> Response:
        q = {k: request.query_params.get(k, "") for k in ("domain", "tier", "outcome",
                                                          "version")}
        items = log.select(**q)
        form = "".join(f"{k} <input name='{k}' value='{e(v)}'> " for k, v in q.items())
        body = (f"<form method='get' action='/rollouts'>{form}<button>filter</button></form>"
                f"<p>{len(items)} of {len(log.scored)}</p>{rollout_rows(items[:500])}")
        return page("rollouts", body)

    async def rollout(request: Request) -> Response:
        s = log.by_id.get(request.query_params.get("id", ""))
        if s is None:
            return page("no such rollout", "<p>not in this run's log</p>")
        r = s.rollout
        turns = decode_transcript(r.completion)
        if turns is not None:  # a tool episode: each turn and what the environment said
            said = "".join(f"<pre>{e(t.text)}</pre><pre class='env'>{e(t.observation)}</pre>"
                           for t in turns)
        else:
            said = f"<pre>{e(r.completion)}</pre>"
        checks = "".join(f"<tr><td>{e(c.name)}</td><td>{'yes' if c.passed else 'no'}</td>"
                         f"<td>{e(c.detail)}</td></tr>" for c in s.checks)
        masked = sum(1 for m in r.loss_mask if not m)
        body = (f"<p>domain {e(r.domain)}, tier {e(r.tier)}, v{e(r.policy_version)}, "
                f"reward {s.reward:.3f}, outcome {e(s.outcome.value)}: {e(s.reason)}</p>"
                f"<p><a href='/task?{urlencode({'id': r.task_id})}'>this task across "
                f"versions</a></p><h2>prompt</h2><pre>{e(r.prompt)}</pre>"
                f"<h2>completion</h2>{said}"
                f"<p>{len(r.output_ids)} output tokens, {masked} of them the environment's "
                "(loss mask 0, greyed above)</p>"
                f"<h2>checks</h2><table>{checks}</table>"
                f"<h2>behaviour logprobs</h2><pre>{e(', '.join(f'{x:.3f}' for x in r.logprobs))}"
                "</pre>")
        return page(f"rollout {r.rollout_id}", body)

    async def task(request: Request) -> Response:
        items = sorted(log.by_task.get(request.query_params.get("id", ""), []),
                       key=lambda s: (s.rollout.policy_version, s.rollout.sample_index))
        return page(f"task {request.query_params.get('id', '')}", rollout_rows(items))

    async def dlq(request: Request) -> Response:
        rows = "".join(f"<tr><td>{e(d.subject)}</td><td>{e(d.actor_id)}</td>"
                       f"<td>{e(d.reason)}</td><td>{e(d.deliveries)}</td></tr>"
                       for d in log.dead_letters)
        return page("dead letters", "<table><tr><th>subject</th><th>actor</th><th>reason</th>"
                                    f"<th>deliveries</th></tr>{rows}</table>")

    async def require_token(request: Request, call_next: Any) -> Response:
        given = request.query_params.get("token") or request.cookies.get(COOKIE, "")
        if not secrets.compare_digest(given, token):
            return Response("a token is needed: use the URL `reinforge ui` printed\n",
                            status_code=403, media_type="text/plain")
        if request.method != "GET":
            return Response("read-only\n", status_code=405, media_type="text/plain")
        response = await call_next(request)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    return Starlette(
        routes=[Route("/", overview), Route("/rollouts", rollouts), Route("/rollout", rollout),
                Route("/task", task), Route("/dlq", dlq)],
        middleware=[Middleware(BaseHTTPMiddleware, dispatch=require_token)])
