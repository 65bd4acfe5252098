"""The run browser: an overview per domain, the rollouts with filters, one rollout with the
verifier's checks and the program's output, a problem's groups across versions, the dead
letters, and (with a `review` callback) a form on each rollout to mark its reward wrong or
flag it as an exploit.

Safe by default:
  * it binds to loopback and every page needs the token printed at start (`?token=...`,
    then a cookie), like Jupyter;
  * it only reads, unless built with `review`: then POST /review is the one route that
    changes anything (it sends a `ReviewMark`), and its form must carry the token too, so
    that no other page can post one with the reviewer's cookie;
  * every piece of run data is untrusted text (completions are the policy's, prompts may be
    users'): it goes through `html.escape` and nowhere else, and the pages carry no script
    of their own, under a Content-Security-Policy that forbids scripts altogether.
"""

from __future__ import annotations

import hashlib
import html
import math
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlencode

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from reinforge.core.messages import Review, ReviewMark, ScoredRollout
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


def page(title: str, body: str, status_code: int = 200) -> HTMLResponse:
    nav = ('<p><a href="/">overview</a> · <a href="/rollouts">rollouts</a> · '
           '<a href="/dlq">dead letters</a></p>')
    doc = (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
           f"<style>{STYLE}</style></head><body>{nav}<h1>{e(title)}</h1>{body}</body></html>")
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"}
    return HTMLResponse(doc, status_code=status_code, headers=headers)


def rollout_rows(items: list[ScoredRollout]) -> str:
    rows = "".join(
        f"<tr><td><a href='/rollout?{urlencode({'id': s.rollout.rollout_id})}'>"
        f"{e(s.rollout.rollout_id)}</a></td><td>{e(s.rollout.domain)}</td>"
        f"<td>{e(s.rollout.tier)}</td><td>v{e(s.rollout.policy_version)}</td>"
        f"<td>{s.reward:.3f}</td><td>{e(s.outcome.value)}</td><td>{e(s.reason)}</td></tr>"
        for s in items)
    return ("<table><tr><th>rollout</th><th>domain</th><th>tier</th><th>version</th>"
            f"<th>reward</th><th>outcome</th><th>reason</th></tr>{rows}</table>")


def tier_mix(items: list[ScoredRollout]) -> str:
    """Each tier's share of `items`, e.g. "t0 25% · t1 75%" (the curriculum's mix)."""
    tiers = Counter(s.rollout.tier for s in items)
    return " · ".join(f"t{t} {100 * n / len(items):.0f}%" for t, n in sorted(tiers.items()))


FILTERS = ("domain", "tier", "outcome", "version", "min_reward", "max_reward")


class BadFilter(ValueError):
    """A filter the rollout browser cannot apply; the text names it."""


def reward_bound(name: str, text: str) -> float | None:
    """A reward filter's bound ("" = none), or BadFilter naming it."""
    if not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadFilter(f"{name}: a number, got {text!r}") from None
    if not math.isfinite(value):
        raise BadFilter(f"{name}: a finite number, got {text!r}")
    return value


class BadMark(ValueError):
    """A review form that cannot become a mark; the text names the field."""


def mark_from_form(s: ScoredRollout, form: dict[str, str], reviewer: str) -> ReviewMark:
    """The `ReviewMark` a review form asks for, or BadMark naming what is wrong."""
    try:
        kind = Review(form.get("kind", ""))
    except ValueError:
        raise BadMark(f"kind: one of {', '.join(k.value for k in Review)}") from None
    text = form.get("corrected_reward", "").strip()
    if not text and kind is Review.EXPLOIT:
        text = "0"  # an exploit earns nothing unless the reviewer says otherwise
    try:
        corrected = float(text)
    except ValueError:
        raise BadMark(f"corrected_reward: a number in [0, 1], got {text!r}") from None
    if not (math.isfinite(corrected) and 0.0 <= corrected <= 1.0):
        raise BadMark(f"corrected_reward: a number in [0, 1], got {text!r}")
    r = s.rollout
    return ReviewMark(rollout_id=r.rollout_id, task_id=r.task_id, domain=r.domain, tier=r.tier,
                      policy_version=r.policy_version, kind=kind, recorded_reward=s.reward,
                      corrected_reward=corrected, note=form.get("note", "")[:2000],
                      reviewer=reviewer, prompt=r.prompt, completion=r.completion,
                      spec=dict(r.spec))


def mark_id(mark: ReviewMark) -> str:
    """The mark's message id: the same mark sent twice is stored once."""
    key = f"{mark.kind.value}|{mark.corrected_reward}|{mark.note}|{mark.reviewer}"
    return f"review:{mark.rollout_id}:{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def review_form(s: ScoredRollout, token: str) -> str:
    kinds = "".join(f"<option value='{k.value}'>{k.value.replace('_', ' ')}</option>"
                    for k in Review)
    return ("<h2>review</h2><form method='post' action='/review'>"
            f"<input type='hidden' name='token' value='{e(token)}'>"
            f"<input type='hidden' name='rollout_id' value='{e(s.rollout.rollout_id)}'>"
            f"<select name='kind'>{kinds}</select> "
            "right reward <input name='corrected_reward' size='5'> "
            "note <input name='note' size='40'> <button>send mark</button></form>")


def marks_table(marks: list[ReviewMark]) -> str:
    rows = "".join(f"<tr><td>{e(m.kind.value)}</td><td>{m.recorded_reward:.3f}</td>"
                   f"<td>{m.corrected_reward:.3f}</td><td>{e(m.reviewer)}</td>"
                   f"<td>{e(m.note)}</td></tr>" for m in marks)
    return ("<table><tr><th>mark</th><th>reward given</th><th>right reward</th>"
            f"<th>reviewer</th><th>note</th></tr>{rows}</table>")


def build_app(log: RunLog, token: str, *,
              review: Callable[[ReviewMark], Awaitable[None]] | None = None,
              reviewer: str = "") -> Starlette:
    """The pages over `log`; with `review`, the review form, whose marks go to `review`."""

    async def overview(request: Request) -> Response:
        per: dict[str, list[ScoredRollout]] = defaultdict(list)
        for s in log.scored:
            per[s.rollout.domain].append(s)
        marked: dict[str, int] = defaultdict(int)
        for m in log.marks:
            marked[m.domain] += 1
        rows = "".join(
            f"<tr><td><a href='/rollouts?{urlencode({'domain': d})}'>{e(d)}</a></td>"
            f"<td>{len(ss)}</td><td>{sum(s.reward for s in ss) / len(ss):.3f}</td>"
            f"<td>{sum(s.outcome.value == 'pass' for s in ss) / len(ss):.3f}</td>"
            f"<td>{tier_mix(ss)}</td><td>v{min(s.rollout.policy_version for s in ss)}–"
            f"v{max(s.rollout.policy_version for s in ss)}</td><td>{marked[d]}</td></tr>"
            for d, ss in sorted(per.items()))
        rollbacks = "".join(f"<li>to v{r.to_version}: {e(r.reason)}</li>"
                            for r in log.rollbacks)
        body = ("<table><tr><th>domain</th><th>rollouts</th><th>mean reward</th>"
                "<th>pass rate</th><th>tier mix</th><th>versions</th><th>review marks</th>"
                f"</tr>{rows}</table>"
                f"<p>{log.scored_per_minute():.1f} rollouts scored per minute; "
                f"{len(log.versions)} versions published; {len(log.rollbacks)} rollbacks"
                f"{':' if rollbacks else '.'}</p>{f'<ul>{rollbacks}</ul>' if rollbacks else ''}"
                f"<p>{len(log.dead_letters)} dead letters; {log.undecodable} records that "
                "did not decode.</p>")
        if log.unreadable:
            since = time.strftime("%H:%M:%S", time.localtime(log.unreadable_since))
            body = (f"<p><b>The run's stream cannot be read since {since}</b> (its nats-server "
                    f"stopped?): {e(log.unreadable)}. Shown: what was read before; trying "
                    "again every few seconds.</p>") + body
        return page("run overview", body)

    async def rollouts(request: Request) -> Response:
        q = {k: request.query_params.get(k, "") for k in FILTERS}
        try:
            bounds = {k: reward_bound(k, q[k]) for k in ("min_reward", "max_reward")}
        except BadFilter as exc:
            return page("rollouts", f"<p><b>{e(exc)}</b></p>", status_code=400)
        items = log.select(**{k: q[k] for k in ("domain", "tier", "outcome", "version")},
                           **bounds)
        form = "".join(f"{k.replace('_', ' ')} <input name='{k}' value='{e(v)}' size='8'> "
                       for k, v in q.items())
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
                f"<h2>program output</h2>"
                f"{f'<pre>{e(s.output)}</pre>' if s.output else '<p>none recorded</p>'}"
                f"<h2>behaviour logprobs</h2><pre>{e(', '.join(f'{x:.3f}' for x in r.logprobs))}"
                "</pre>")
        marks = log.marks_of.get(r.rollout_id, [])
        if marks:
            body += f"<h2>review marks</h2>{marks_table(marks)}"
        if request.query_params.get("sent"):
            body += ("<p><b>mark sent</b>: stored in the run's log; it is listed above once "
                     "read back from there.</p>")
        if review is not None:
            body += review_form(s, token)
        return page(f"rollout {r.rollout_id}", body)

    async def send_review(request: Request) -> Response:
        assert review is not None
        fields = parse_qs((await request.body()).decode("utf-8", "replace"))
        form = {k: v[0] for k, v in fields.items()}
        if not secrets.compare_digest(form.get("token", ""), token):
            return Response("the form must carry the token\n", status_code=403,
                            media_type="text/plain")
        s = log.by_id.get(form.get("rollout_id", ""))
        if s is None:
            return Response("rollout_id: not in this run's log\n", status_code=400,
                            media_type="text/plain")
        try:
            mark = mark_from_form(s, form, reviewer)
        except BadMark as exc:
            return Response(f"{exc}\n", status_code=400, media_type="text/plain")
        await review(mark)
        return RedirectResponse(f"/rollout?{urlencode({'id': s.rollout.rollout_id, 'sent': 1})}",
                                status_code=303)

    async def task(request: Request) -> Response:
        problem = log.problem_of_task.get(request.query_params.get("id", ""))
        if problem is None:
            return page("no such task", "<p>not in this run's log</p>")
        items = sorted(log.by_problem[problem],
                       key=lambda s: (s.rollout.policy_version, s.rollout.task_id,
                                      s.rollout.sample_index))
        groups: dict[str, list[ScoredRollout]] = defaultdict(list)
        for s in items:
            groups[s.rollout.task_id].append(s)
        rows = "".join(
            f"<tr><td>{e(tid)}</td><td>v{e(ss[0].rollout.policy_version)}</td>"
            f"<td>{len(ss)}</td><td>{sum(s.outcome.value == 'pass' for s in ss)}</td>"
            f"<td>{sum(s.reward for s in ss) / len(ss):.3f}</td></tr>"
            for tid, ss in groups.items())
        first = items[0].rollout
        body = (f"<p>{len(groups)} groups of this problem ({e(first.domain)}, tier "
                f"{e(first.tier)}), by version</p><pre>{e(first.prompt)}</pre>"
                "<table><tr><th>group</th><th>version</th><th>samples</th><th>passed</th>"
                f"<th>mean reward</th></tr>{rows}</table><h2>its rollouts</h2>"
                f"{rollout_rows(items)}")
        return page(f"task {first.task_id}", body)

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
        writes = review is not None and request.url.path == "/review"
        if request.method != ("POST" if writes else "GET"):
            return Response("read-only\n" if review is None else "method not allowed\n",
                            status_code=405, media_type="text/plain")
        response = await call_next(request)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    routes = [Route("/", overview), Route("/rollouts", rollouts), Route("/rollout", rollout),
              Route("/task", task), Route("/dlq", dlq)]
    if review is not None:
        routes.append(Route("/review", send_review, methods=["POST"]))
    return Starlette(
        routes=routes,
        middleware=[Middleware(BaseHTTPMiddleware, dispatch=require_token)])
