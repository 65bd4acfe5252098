"""`reinforge report RUN`: a Markdown page with PNG plots and the final figures of a run.

Reads only `<run_dir>/metrics/metrics.jsonl` (written by the monitor), so it works after
the run, on a copied file, and on partial data: whatever is missing (no evaluations, no
learner stats yet, a domain never evaluated) is said on the page and in `report.json`,
never a crash. Writes into `<out>` (default `<run_dir>/report/`):

  reward_pass_rate.png  reward and pass rate per domain over time (train samples)
  eval.png              evaluation pass@1 / pass@k per domain: first vs last version
  proxy_gold.png        held-out reward against the gold check per version (domains with one)
  throughput.png        samples/s (per domain) and the policy version / learner step
  staleness.png         policy lag of scored samples (and the learner's own figure)
  tier_mix.png          share of samples per difficulty tier over time, per domain
  processes.png         CPU and resident memory per process (from heartbeats)
  report.md             the page;  report.json  the figures as data

The maths (binning, before/after windows) are pure functions over record lists.
"""

from __future__ import annotations

import collections
import math
import time
from pathlib import Path
from typing import Any

import msgspec

from reinforge.metrics.writers import read_jsonl, write_json_file
from reinforge.rl.scoring import mean_or_none

Record = dict[str, Any]


class Report(msgspec.Struct, frozen=True, kw_only=True):
    run: str
    out_dir: str
    page: str
    """Path of report.md."""
    plots: list[str]
    """File names of the PNGs written (relative to out_dir)."""
    missing: list[str]
    """What the data did not have, in words."""
    figures: dict[str, Any]
    domains: dict[str, dict[str, Any]]
    processes: dict[str, dict[str, Any]]


# ----------------------------------------------------------------------------- maths


def by_kind(records: list[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = collections.defaultdict(list)
    for r in records:
        out[r["kind"]].append(r)
    return out


def bin_width_s(duration_s: float, n_bins: int = 40) -> float:
    """A round bin width giving about `n_bins` bins over the run (at least 1 s)."""
    raw = max(duration_s / n_bins, 1.0)
    for nice in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if raw <= nice:
            return float(nice)
    return float(math.ceil(raw / 3600) * 3600)


def binned(points: list[tuple[float, float]], t0: float, width_s: float
           ) -> list[tuple[float, float, int]]:
    """(bin centre in s since t0, mean value, count) for each non-empty bin, in time order."""
    sums: dict[int, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for t, v in points:
        acc = sums[int((t - t0) // width_s)]
        acc[0] += v
        acc[1] += 1
    return [((i + 0.5) * width_s, s / n, int(n)) for i, (s, n) in sorted(sums.items())]


def counts_per_bin(times: list[float], t0: float, width_s: float, n_bins: int
                   ) -> list[int]:
    out = [0] * n_bins
    for t in times:
        i = int((t - t0) // width_s)
        if 0 <= i < n_bins:
            out[i] += 1
    return out


def early_late(values: list[float], fraction: float = 0.2) -> tuple[float | None, float | None]:
    """Means of the first and last `fraction` of a time-ordered series (at least one each)."""
    if not values:
        return None, None
    n = max(1, int(len(values) * fraction))
    return sum(values[:n]) / n, sum(values[-n:]) / n


def _is_signal(r: Record) -> bool:
    return r.get("outcome") != "infra_error"


def train_samples(scored: list[Record]) -> list[Record]:
    """Training samples only (evaluation samples would mix two policies' behaviours)."""
    train = [r for r in scored if r.get("purpose", "train") == "train"]
    return train or scored


def logprob_gap_over_run(train: list[Record]) -> dict[str, float]:
    """Rollout vs learner logprob gap and TIS over every learner step that reported them:
    mean of the per-step means, max of the maxima, mean capped share ({} if none did)."""
    figs = [r.get("figures", {}) for r in train]
    gaps = [f for f in figs if "logp_mismatch_mean_nats" in f]
    out: dict[str, float] = {}
    if gaps:
        means = [f["logp_mismatch_mean_nats"] for f in gaps]
        out["logp_mismatch_mean_nats"] = sum(means) / len(means)
        out["logp_mismatch_max_nats"] = max(f.get("logp_mismatch_max_nats", 0.0) for f in gaps)
    capped = [f["tis_capped_share"] for f in figs if "tis_capped_share" in f]
    if capped:
        out["tis_capped_share_mean"] = sum(capped) / len(capped)
    return out


MASTERED_AT = 0.9
"""A domain whose last held-out pass@1 reaches this is mastered (the frontier table)."""


def in_run_order(r: Record) -> tuple[int, int, float]:
    """The key that orders evaluation and learner records as the run made them: a version
    (or step) number comes back after a rollback, in a newer epoch."""
    return (int(r.get("epoch", 0)), int(r.get("version", r.get("step", 0))), float(r["t"]))


def frontier(evals: list[Record]) -> dict[str, str]:
    """Where each evaluated domain stands: "out of reach" (pass@1 0 in every evaluation),
    "one answer" (the last evaluation's policy gave one final answer to most tasks:
    collapsed onto the answer prior, whatever its pass@1), "mastered" (last pass@1 >=
    MASTERED_AT), else "learning"."""
    from reinforge.rl.scoring import COLLAPSED_MODE_SHARE

    by_domain: dict[str, list[Record]] = collections.defaultdict(list)
    for r in evals:
        by_domain[r["domain"]].append(r)
    out = {}
    for d, rows in by_domain.items():
        rows.sort(key=in_run_order)
        if all(r["pass_at_1"] == 0 for r in rows):
            out[d] = "out of reach"
        elif rows[-1].get("figures", {}).get("answer_mode_share", 0.0) >= COLLAPSED_MODE_SHARE:
            out[d] = "one answer"
        elif rows[-1]["pass_at_1"] >= MASTERED_AT:
            out[d] = "mastered"
        else:
            out[d] = "learning"
    return out


def review_figures(marks: list[Record]) -> dict[str, Any]:
    """A domain's review marks (`reinforge ui --review`): how many of each kind, on how many
    rollouts, and the mean of (right reward - reward given)."""
    return {
        "review_marks": len(marks),
        "reviewed_rollouts": len({r["rollout_id"] for r in marks}),
        "marked_wrong_reward": sum(r["mark"] == "wrong_reward" for r in marks),
        "marked_exploit": sum(r["mark"] == "exploit" for r in marks),
        "review_correction_mean": mean_or_none([float(r["corrected_reward"]) - float(r["recorded_reward"])
                                         for r in marks]),
    }


def proxy_and_gold(evals: list[Record]) -> dict[str, Any]:
    """A domain's evaluations (by version) in a domain with a gold check: its mean reward
    (the proxy a learned reward model gives) and gold pass rate, first and last, and by
    version. Empty for a domain without one."""
    gold = [r for r in evals if "gold_pass_rate" in r.get("figures", {})]
    if not gold:
        return {}
    by_version = [[r["version"], r["figures"].get("reward_mean"), r["figures"]["gold_pass_rate"]]
                  for r in gold]
    return {"eval_reward_first": by_version[0][1], "eval_reward_last": by_version[-1][1],
            "eval_gold_first": by_version[0][2], "eval_gold_last": by_version[-1][2],
            "proxy_gold_by_version": by_version}


def summarise(records: list[Record]) -> tuple[dict[str, Any], dict[str, dict[str, Any]],
                                              dict[str, dict[str, Any]], list[str]]:
    """The final figures: global, per domain, per process type; and what is missing."""
    kinds = by_kind(records)
    scored = sorted(train_samples(kinds.get("scored", [])), key=lambda r: r["t"])
    evals = kinds.get("eval", [])
    train = sorted(kinds.get("train", []), key=lambda r: (r.get("epoch", 0), r["step"], r["t"]))
    weights = kinds.get("weights", [])
    snaps = kinds.get("snapshot", [])
    missing: list[str] = []
    t_start = min(r["t"] for r in records) if records else 0.0
    t_end = max(r["t"] for r in records) if records else 0.0
    duration = t_end - t_start
    if not scored:
        missing.append("no scored rollouts: no reward, pass rate, throughput or tier figures")
    if not train:
        missing.append("no learner stats (TrainStats): no loss or learner figures")
    if not evals:
        missing.append("no evaluation stats (EvalStats): no before/after comparison")
    if not snaps:
        missing.append("no monitor snapshots: no process CPU/memory or queue figures")

    moves = sorted(weights + kinds.get("rollback", []), key=lambda r: r["t"])
    last_version = (moves[-1].get("version", moves[-1].get("to_version")) if moves
                    else snaps[-1].get("policy_version") if snaps else None)
    signal = [r for r in scored if _is_signal(r)]
    stale = [float(r["staleness"]) for r in scored if r.get("staleness") is not None]
    figures: dict[str, Any] = {
        "duration_s": duration,
        "samples_scored": len(scored),
        "samples_per_s": len(scored) / duration if duration > 0 and scored else None,
        "tokens_generated": sum(int(r.get("tokens", 0)) for r in scored),
        "reward_mean": mean_or_none([float(r["reward"]) for r in signal]),
        "pass_rate": mean_or_none([1.0 if r["outcome"] == "pass" else 0.0 for r in signal]),
        "infra_errors": len(scored) - len(signal),
        "policy_version": last_version,
        "versions_published": len(weights),
        "rollbacks": len(kinds.get("rollback", [])),
        "train_steps": len(train),
        "final_loss": train[-1]["loss"] if train else None,
        "staleness_mean": mean_or_none(stale),
        "staleness_max": max(stale) if stale else None,
    }
    marks = kinds.get("review", [])
    figures["review_marks"] = len(marks)
    figures.update(logprob_gap_over_run(train))
    if train:
        for name, value in sorted(train[-1].get("figures", {}).items()):
            figures[f"learner_{name}"] = value

    domains: dict[str, dict[str, Any]] = {}
    places = frontier(evals)
    names = sorted({r["domain"] for r in scored} | {r["domain"] for r in evals}
                   | {r["domain"] for r in marks})
    for d in names:
        rows = [r for r in scored if r["domain"] == d]
        sig = [r for r in rows if _is_signal(r)]
        rewards = [float(r["reward"]) for r in sig]
        passes = [1.0 if r["outcome"] == "pass" else 0.0 for r in sig]
        r0, r1 = early_late(rewards)
        p0, p1 = early_late(passes)
        t0, t1 = early_late([float(r["tier"]) for r in rows])
        dev = sorted((r for r in evals if r["domain"] == d), key=in_run_order)
        info: dict[str, Any] = {
            "samples": len(rows), "infra_errors": len(rows) - len(sig),
            "reward_first": r0, "reward_last": r1, "pass_rate_first": p0, "pass_rate_last": p1,
            "tier_first": t0, "tier_last": t1,
            "eval_first_version": dev[0]["version"] if dev else None,
            "eval_last_version": dev[-1]["version"] if dev else None,
            "eval_pass_at_1_first": dev[0]["pass_at_1"] if dev else None,
            "eval_pass_at_1_last": dev[-1]["pass_at_1"] if dev else None,
            "eval_pass_at_k_first": dev[0]["pass_at_k"] if dev else None,
            "eval_pass_at_k_last": dev[-1]["pass_at_k"] if dev else None,
            "eval_k": dev[-1].get("k") if dev else None,
            "frontier": places.get(d, "not evaluated"),
            **review_figures([r for r in marks if r["domain"] == d]),
            **proxy_and_gold(dev),
        }
        domains[d] = info
        if not rows and dev:
            missing.append(f"domain {d}: evaluated but no training samples scored")
        if not dev and evals:
            missing.append(f"domain {d}: no evaluation stats")
        elif len(dev) == 1:
            missing.append(f"domain {d}: evaluated once only (v{dev[0]['version']}): "
                           "no before/after difference")

    processes: dict[str, dict[str, Any]] = {}
    per_type: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: {"cpu": [], "rss": [], "ids": []})
    for s in snaps:
        for p in s.get("processes", []):
            acc = per_type[p["actor_type"]]
            acc["cpu"].append(float(p["cpu_percent"]))
            acc["rss"].append(float(p["rss_bytes"]))
            acc["ids"].append(p["actor_id"])  # type: ignore[arg-type]
    for kind, acc in sorted(per_type.items()):
        processes[kind] = {
            "processes": len(set(acc["ids"])),
            "cpu_percent_mean": mean_or_none(acc["cpu"]),
            "cpu_percent_max": max(acc["cpu"]),
            "rss_mib_max": max(acc["rss"]) / 2**20,
        }
    return figures, domains, processes, missing


# ----------------------------------------------------------------------------- plots


def _figure(nrows: int = 1, ncols: int = 1, *, height: float = 3.2, width: float = 9.0):
    from matplotlib.figure import Figure  # no pyplot: no global figure state

    fig = Figure(figsize=(width, height * nrows), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _minutes(seconds: float) -> float:
    return seconds / 60.0


def plot_reward_pass_rate(scored: list[Record], t0: float, width_s: float, path: Path) -> bool:
    rows = [r for r in scored if _is_signal(r)]
    if not rows:
        return False
    fig, (ax_r, ax_p) = _figure(2)
    for d in sorted({r["domain"] for r in rows}):
        mine = [r for r in rows if r["domain"] == d]
        rew = binned([(r["t"], float(r["reward"])) for r in mine], t0, width_s)
        pas = binned([(r["t"], 1.0 if r["outcome"] == "pass" else 0.0) for r in mine], t0,
                     width_s)
        ax_r.plot([_minutes(x) for x, _, _ in rew], [v for _, v, _ in rew], marker="o",
                  markersize=3, label=d)
        ax_p.plot([_minutes(x) for x, _, _ in pas], [v for _, v, _ in pas], marker="o",
                  markersize=3, label=d)
    ax_r.set_title(f"mean reward per domain (training samples, {width_s:g} s bins)")
    ax_r.set_ylabel("reward")
    ax_p.set_title("pass rate per domain (infra errors masked)")
    ax_p.set_ylabel("pass rate")
    ax_p.set_ylim(-0.05, 1.05)
    for ax in (ax_r, ax_p):
        ax.set_xlabel("minutes since start")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.savefig(path)
    return True


def plot_eval(domains: dict[str, dict[str, Any]], path: Path) -> bool:
    names = [d for d, v in domains.items() if v["eval_last_version"] is not None]
    if not names:
        return False
    fig, (ax,) = _figure(1, height=3.6)
    width = 0.2
    series = [
        ("pass@1 first", "eval_pass_at_1_first", "#9ecae1", ""),
        ("pass@1 last", "eval_pass_at_1_last", "#3182bd", ""),
        ("pass@k first", "eval_pass_at_k_first", "#fdae6b", "//"),
        ("pass@k last", "eval_pass_at_k_last", "#e6550d", "//"),
    ]
    for i, (label, key, color, hatch) in enumerate(series):
        xs = [j + (i - 1.5) * width for j in range(len(names))]
        ys = [domains[d][key] or 0.0 for d in names]
        bars = ax.bar(xs, ys, width, label=label, color=color, hatch=hatch, edgecolor="black",
                      linewidth=0.5)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(names)), [
        f"{d}\nv{domains[d]['eval_first_version']} → v{domains[d]['eval_last_version']}"
        for d in names])
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("held-out score")
    ax.set_title("evaluation per domain: first vs last evaluated policy version")
    never = [d for d, v in domains.items() if v["eval_last_version"] is None]
    if never:
        ax.set_xlabel(f"not evaluated: {', '.join(never)}", color="gray")
    ax.legend(loc="upper left", fontsize=8, ncols=4)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path)
    return True


def plot_proxy_gold(domains: dict[str, dict[str, Any]], path: Path) -> bool:
    golds = {d: v["proxy_gold_by_version"] for d, v in domains.items()
             if v.get("proxy_gold_by_version")}
    if not golds:
        return False
    fig, (ax,) = _figure(1, height=3.4)
    for i, (d, rows) in enumerate(sorted(golds.items())):
        color = f"C{i % 10}"
        versions = [v for v, _, _ in rows]
        ax.plot(versions, [r if r is not None else math.nan for _, r, _ in rows], "-o",
                color=color, markersize=3, label=f"{d}: reward (proxy)")
        ax.plot(versions, [g for _, _, g in rows], "--s", color=color, markersize=3,
                label=f"{d}: gold pass rate")
    ax.set_xlabel("policy version")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("held-out reward (proxy) against the gold check, per version")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.savefig(path)
    return True


def plot_eval_heatmap(evals: list[Record], path: Path) -> bool:
    """Held-out pass@1 per domain (rows) and evaluated version (columns); blank: that
    version did not evaluate the domain (a rotation)."""
    import numpy as np

    if not evals:
        return False
    names = sorted({r["domain"] for r in evals})
    versions = sorted({(r.get("epoch", 0), r["version"]) for r in evals})
    grid = np.full((len(names), len(versions)), np.nan)
    for r in sorted(evals, key=lambda r: r["t"]):  # the newest evaluation of a cell wins
        grid[names.index(r["domain"]),
             versions.index((r.get("epoch", 0), r["version"]))] = r["pass_at_1"]
    fig, (ax,) = _figure(1, height=min(40.0, 1.2 + 0.22 * len(names)),
                         width=min(24.0, 4.0 + 0.25 * len(versions)))
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", vmin=0.0, vmax=1.0,
                      cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(names)), names, fontsize=6 if len(names) > 30 else 8)
    step = max(1, len(versions) // 20)
    ax.set_xticks(range(0, len(versions), step),
                  [f"v{v}" + (f"/e{e}" if e else "") for e, v in versions[::step]], fontsize=7)
    ax.set_xlabel("policy version evaluated (/eN: after the Nth rollback)")
    ax.set_title("held-out pass@1 per domain over versions")
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02)
    fig.savefig(path)
    return True


def plot_throughput(scored: list[Record], kinds: dict[str, list[Record]], t0: float,
                    duration_s: float, width_s: float, path: Path) -> bool:
    weights = sorted(kinds.get("weights", []), key=lambda r: r["t"])
    train = sorted(kinds.get("train", []), key=lambda r: r["t"])
    if not scored and not weights and not train:
        return False
    fig, (ax_s, ax_v) = _figure(2)
    n_bins = max(1, int(math.ceil(duration_s / width_s)))
    centres = [_minutes((i + 0.5) * width_s) for i in range(n_bins)]
    if scored:
        total = counts_per_bin([r["t"] for r in scored], t0, width_s, n_bins)
        ax_s.plot(centres, [c / width_s for c in total], color="black", linewidth=2,
                  label="all domains")
        for d in sorted({r["domain"] for r in scored}):
            counts = counts_per_bin([r["t"] for r in scored if r["domain"] == d], t0, width_s,
                                    n_bins)
            ax_s.plot(centres, [c / width_s for c in counts], linewidth=1, label=d)
        ax_s.legend(loc="best", fontsize=8)
    else:
        ax_s.text(0.5, 0.5, "no scored samples", ha="center", transform=ax_s.transAxes)
    ax_s.set_title(f"throughput: scored samples per second ({width_s:g} s bins)")
    ax_s.set_ylabel("samples/s")
    if weights:
        ax_v.step([_minutes(r["t"] - t0) for r in weights], [r["version"] for r in weights],
                  where="post", label="policy version published", color="tab:blue")
    for r in kinds.get("rollback", []):
        ax_v.axvline(_minutes(r["t"] - t0), color="red", linestyle="--", linewidth=1)
    if train:
        ax_t = ax_v.twinx()
        ax_t.plot([_minutes(r["t"] - t0) for r in train], [r["step"] for r in train],
                  color="tab:green", marker=".", label="learner step")
        ax_t.set_ylabel("learner step", color="tab:green")
    ax_v.set_ylabel("policy version", color="tab:blue")
    ax_v.set_title("learner progress (red dashes: rollbacks)")
    for ax in (ax_s, ax_v):
        ax.set_xlabel("minutes since start")
        ax.grid(alpha=0.3)
    fig.savefig(path)
    return True


def plot_staleness(scored: list[Record], train: list[Record], t0: float, width_s: float,
                   path: Path) -> bool:
    pts = [(r["t"], float(r["staleness"])) for r in scored if r.get("staleness") is not None]
    learner = [(r["t"], float(r["figures"]["staleness"])) for r in train
               if isinstance(r.get("figures"), dict) and "staleness" in r["figures"]]
    if not pts and not learner:
        return False
    fig, (ax,) = _figure(1)
    if pts:
        b = binned(pts, t0, width_s)
        ax.plot([_minutes(x) for x, _, _ in b], [v for _, v, _ in b], marker="o", markersize=3,
                label="scored samples, mean per bin\n(version at scoring − sample's version)")
        mx_b: dict[int, float] = {}
        for t, v in pts:
            i = int((t - t0) // width_s)
            mx_b[i] = max(mx_b.get(i, 0.0), v)
        ax.plot([_minutes((i + 0.5) * width_s) for i in sorted(mx_b)],
                [mx_b[i] for i in sorted(mx_b)], linestyle=":", label="max per bin")
    if learner:
        ax.plot([_minutes(t - t0) for t, _ in learner], [v for _, v in learner], marker="x",
                label="learner's staleness figure\nper step")
    ax.set_title("staleness (policy versions behind)")
    ax.set_xlabel("minutes since start")
    ax.set_ylabel("versions")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.savefig(path)
    return True


def plot_tier_mix(scored: list[Record], t0: float, duration_s: float, width_s: float,
                  path: Path) -> bool:
    if not scored:
        return False
    names = sorted({r["domain"] for r in scored})
    tiers = sorted({int(r["tier"]) for r in scored})
    n_bins = max(1, int(math.ceil(duration_s / width_s)))
    fig, axes = _figure(len(names), height=2.4)
    centres = [_minutes((i + 0.5) * width_s) for i in range(n_bins)]
    for ax, d in zip(axes, names, strict=True):
        rows = [r for r in scored if r["domain"] == d]
        per_tier = {t: counts_per_bin([r["t"] for r in rows if int(r["tier"]) == t], t0,
                                      width_s, n_bins) for t in tiers}
        totals = [sum(per_tier[t][i] for t in tiers) for i in range(n_bins)]
        keep = [i for i in range(n_bins) if totals[i]]
        shares = [[per_tier[t][i] / totals[i] for i in keep] for t in tiers]
        ax.stackplot([centres[i] for i in keep], shares, labels=[f"tier {t}" for t in tiers],
                     step="mid")
        ax.set_ylim(0, 1)
        ax.set_ylabel("share")
        ax.set_title(f"tier mix: {d}", fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axes[-1].set_xlabel("minutes since start")
    fig.savefig(path)
    return True


def plot_processes(snaps: list[Record], t0: float, path: Path) -> bool:
    series: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for s in snaps:
        for p in s.get("processes", []):
            series[f"{p['actor_type']} {p['actor_id'][-4:]}"].append(
                (s["t"], float(p["cpu_percent"]), p["rss_bytes"] / 2**20))
    if not series:
        return False
    fig, (ax_c, ax_m) = _figure(2)
    for name, pts in sorted(series.items()):
        xs = [_minutes(t - t0) for t, _, _ in pts]
        ax_c.plot(xs, [c for _, c, _ in pts], label=name)
        ax_m.plot(xs, [m for _, _, m in pts], label=name)
    ax_c.set_title("process CPU (100 % = one core)")
    ax_c.set_ylabel("CPU %")
    ax_m.set_title("process resident memory")
    ax_m.set_ylabel("RSS MiB")
    for ax in (ax_c, ax_m):
        ax.set_xlabel("minutes since start")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.savefig(path)
    return True


# ----------------------------------------------------------------------------- the page


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e3 else f"{value:,.0f}"
    return str(value)


def _arrow(a: Any, b: Any) -> str:
    return "–" if a is None and b is None else f"{_fmt(a)} → {_fmt(b)}"


FIGURE_LABELS = {
    "duration_s": "duration (s)", "samples_scored": "samples scored (training)",
    "samples_per_s": "samples/s (mean)", "tokens_generated": "tokens generated",
    "reward_mean": "reward (mean, all samples)", "pass_rate": "pass rate (all samples)",
    "infra_errors": "infra errors (masked)", "policy_version": "final policy version",
    "versions_published": "versions published", "rollbacks": "rollbacks",
    "train_steps": "learner steps", "final_loss": "final loss",
    "staleness_mean": "staleness (mean versions)", "staleness_max": "staleness (max)",
    "logp_mismatch_mean_nats": "rollout vs learner |Δlogp| (mean of steps, nats)",
    "logp_mismatch_max_nats": "rollout vs learner |Δlogp| (max, nats)",
    "tis_capped_share_mean": "TIS: share of tokens capped (mean of steps)",
    "review_marks": "review marks (reinforge ui --review)",
}

PLOTS = [
    ("reward_pass_rate.png", "Reward and pass rate per domain"),
    ("eval.png", "Evaluation before/after per domain"),
    ("eval_heatmap.png", "Held-out pass@1 per domain over versions"),
    ("proxy_gold.png", "Reward (proxy) against gold, per version"),
    ("throughput.png", "Throughput and learner progress"),
    ("staleness.png", "Staleness"),
    ("tier_mix.png", "Curriculum tier mix"),
    ("processes.png", "Process CPU and memory"),
]


def render_markdown(run: str, figures: dict[str, Any], domains: dict[str, dict[str, Any]],
                    processes: dict[str, dict[str, Any]], plots: list[str],
                    missing: list[str], source: str) -> str:
    lines = [f"# reinforge run `{run}`", "",
             f"From `{source}`, generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}.",
             ""]
    if missing:
        lines += ["## Missing data", ""] + [f"- {m}" for m in missing] + [""]
    lines += ["## Final figures", "", "| figure | value |", "|---|---|"]
    for key, value in figures.items():
        lines.append(f"| {FIGURE_LABELS.get(key, key.replace('_', ' '))} | {_fmt(value)} |")
    lines.append("")
    if domains:
        lines += ["### Per domain", "",
                  "first → last: mean over the first and last 20 % of the domain's training "
                  "samples; eval: first and last evaluated policy version.", "",
                  "| domain | samples | infra err | reward | pass rate | tier | eval versions "
                  "| eval pass@1 | eval pass@k |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for d, v in domains.items():
            versions = ("–" if v["eval_first_version"] is None
                        else f"v{v['eval_first_version']} → v{v['eval_last_version']}")
            k = f" (k={v['eval_k']})" if v.get("eval_k") else ""
            lines.append(
                f"| {d} | {v['samples']} | {v['infra_errors']} "
                f"| {_arrow(v['reward_first'], v['reward_last'])} "
                f"| {_arrow(v['pass_rate_first'], v['pass_rate_last'])} "
                f"| {_arrow(v['tier_first'], v['tier_last'])} | {versions} "
                f"| {_arrow(v['eval_pass_at_1_first'], v['eval_pass_at_1_last'])} "
                f"| {_arrow(v['eval_pass_at_k_first'], v['eval_pass_at_k_last'])}{k} |")
        lines.append("")
    golds = {d: v for d, v in domains.items() if "eval_gold_first" in v}
    if golds:
        lines += ["### Proxy and gold", "",
                  "Domains rewarded by a learned model, with a gold check (a rule the reward "
                  "only approximates, never rewarded): held-out mean reward against gold pass "
                  "rate, first → last evaluation. The reward rising while the gold falls is "
                  "over-optimisation; the evaluator rolls such a version back.", "",
                  "| domain | eval versions | reward (proxy) | gold pass rate |",
                  "|---|---|---|---|"]
        for d, v in golds.items():
            lines.append(f"| {d} | v{v['eval_first_version']} → v{v['eval_last_version']} "
                         f"| {_arrow(v['eval_reward_first'], v['eval_reward_last'])} "
                         f"| {_arrow(v['eval_gold_first'], v['eval_gold_last'])} |")
        lines.append("")
    if figures.get("review_marks"):
        lines += ["### Review marks", "",
                  "Marks people made on rollouts in `reinforge ui --review`: a reward marked "
                  "wrong, or a rollout flagged as an exploit; the correction is the right "
                  "reward minus the one given, averaged.", "",
                  "| domain | marks | rollouts | wrong reward | exploit | mean correction |",
                  "|---|---|---|---|---|---|"]
        for d, v in domains.items():
            if v["review_marks"]:
                lines.append(f"| {d} | {v['review_marks']} | {v['reviewed_rollouts']} "
                             f"| {v['marked_wrong_reward']} | {v['marked_exploit']} "
                             f"| {_fmt(v['review_correction_mean'])} |")
        lines.append("")
    places: dict[str, list[str]] = collections.defaultdict(list)
    for d, v in domains.items():
        places[v.get("frontier", "not evaluated")].append(d)
    if any(p != "not evaluated" for p in places):
        lines += ["### Frontier", "",
                  f"From the held-out evaluations: mastered = last pass@1 >= {MASTERED_AT}, "
                  "out of reach = pass@1 0 in every evaluation, one answer = the last "
                  "evaluation's policy gave one final answer to most tasks (the answer "
                  "prior, not a skill), learning = the rest.", "",
                  "| place | domains | which |", "|---|---|---|"]
        for place in ("learning", "mastered", "one answer", "out of reach", "not evaluated"):
            names = sorted(places.get(place, []))
            shown = ", ".join(names[:12]) + (f", ... ({len(names) - 12} more)"
                                             if len(names) > 12 else "")
            lines.append(f"| {place} | {len(names)} | {shown or '–'} |")
        lines.append("")
    if processes:
        lines += ["### Per process type", "",
                  "| actor type | processes | CPU % mean | CPU % max | RSS MiB max |",
                  "|---|---|---|---|---|"]
        for kind, v in processes.items():
            lines.append(f"| {kind} | {v['processes']} | {_fmt(v['cpu_percent_mean'])} "
                         f"| {_fmt(v['cpu_percent_max'])} | {_fmt(v['rss_mib_max'])} |")
        lines.append("")
    lines += ["## Plots", ""]
    for name, title in PLOTS:
        lines.append(f"### {title}")
        lines.append("")
        lines.append(f"![{title}]({name})" if name in plots
                     else "_not drawn: the data has nothing for it (see Missing data)._")
        lines.append("")
    return "\n".join(lines)


def build_report(metrics_path: Path, out_dir: Path, *, run: str = "") -> Report:
    """Read a metrics.jsonl and write the plots, report.md and report.json into out_dir."""
    metrics_path = Path(metrics_path)
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics file at {metrics_path} (is a monitor running "
                                "for this run? it writes <run_dir>/metrics/metrics.jsonl)")
    records = sorted(read_jsonl(metrics_path), key=lambda r: r["t"])
    kinds = by_kind(records)
    if not run:
        run = next((r.get("run", "") for r in kinds.get("start", [])), "") or \
            metrics_path.parent.parent.name
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures, domains, processes, missing = summarise(records)
    if not records:
        missing.insert(0, f"{metrics_path} holds no records")

    t0 = records[0]["t"] if records else 0.0
    duration = (records[-1]["t"] - t0) if records else 0.0
    width = bin_width_s(duration)
    scored = sorted(train_samples(kinds.get("scored", [])), key=lambda r: r["t"])
    drawers = {
        "reward_pass_rate.png": lambda p: plot_reward_pass_rate(scored, t0, width, p),
        "eval.png": lambda p: plot_eval(domains, p),
        "eval_heatmap.png": lambda p: plot_eval_heatmap(kinds.get("eval", []), p),
        "proxy_gold.png": lambda p: plot_proxy_gold(domains, p),
        "throughput.png": lambda p: plot_throughput(scored, kinds, t0, duration, width, p),
        "staleness.png": lambda p: plot_staleness(scored, kinds.get("train", []), t0, width, p),
        "tier_mix.png": lambda p: plot_tier_mix(scored, t0, duration, width, p),
        "processes.png": lambda p: plot_processes(kinds.get("snapshot", []), t0, p),
    }
    plots: list[str] = []
    for name, draw in drawers.items():
        path = out_dir / name
        if draw(path):
            plots.append(name)
        elif path.exists():
            path.unlink()  # a stale plot from an earlier report would claim data we lack

    page = out_dir / "report.md"
    page.write_text(render_markdown(run, figures, domains, processes, plots, missing,
                                    str(metrics_path)), encoding="utf-8")
    report = Report(run=run, out_dir=str(out_dir), page=str(page), plots=plots,
                    missing=missing, figures=figures, domains=domains, processes=processes)
    write_json_file(out_dir / "report.json", msgspec.to_builtins(report))
    return report
