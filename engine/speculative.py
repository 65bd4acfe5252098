"""Speculative decoding without a draft model: prompt lookup (n-gram) drafts, verified by the
policy itself in one forward pass.

Drafting: the sequence's last n tokens (n = max_n down to 1) are looked up among its earlier
tokens (prompt and output); the tokens that followed their latest earlier occurrence are the
draft. RL rollouts repeat themselves (code echoing its prompt, answers restating the
question, multi-turn histories), which is where this pays.

Verification: one forward pass over the last emitted token and the k draft tokens gives the
policy's distribution at each of the k + 1 positions. Acceptance keeps the policy's output
distribution exactly: greedy takes the argmax while it equals the draft; sampling accepts a
draft token d with probability p(d) (p: the policy's distribution after temperature and
top-k/top-p/min-p truncation; the draft is a point mass) and on a rejection samples from p
with d removed, renormalised (Leviathan et al.'s rule for a deterministic draft). After k
acceptances one more token comes from the last position for free. Each emitted token's
logprob is the one plain decoding reports (`sampling.token_logprobs`), so the behaviour
logprobs the learner reads do not change.
"""

from __future__ import annotations

import torch
from reinforge.engine.sampling import sample_tokens


class NgramIndex:
    """Where each n-gram (n <= max_n) of a sequence last ended, kept as tokens are appended.

    `seen[gram]` is the end (exclusive) of the gram's latest occurrence that ends before the
    sequence's last token, so the sequence's own tail is never its own match."""

    def __init__(self, tokens: list[int], max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.seen: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        t = self.tokens
        for tok in new:
            end = len(t)  # the grams ending here stop before the token now appended
            for n in range(1, min(self.max_n, end) + 1):
                self.seen[tuple(t[end - n : end])] = end
            t.append(tok)

    def draft(self, k: int) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the longest tail n-gram
        found; [] when none recurs."""
        t = self.tokens
        for n in range(min(self.max_n, len(t)), 0, -1):
            end = self.seen.get(tuple(t[len(t) - n :]))
            if end is not None:
                # copy on past the sequence's end from the draft itself (as LZ77 does): a
                # period shorter than k still gives k tokens
                out: list[int] = []
                for j in range(end, end + k):
                    out.append(t[j] if j < len(t) else out[j - len(t)])
                return out
        return []


def accept(
    draft: list[int],
    logprobs: torch.Tensor,
    keep: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None,
) -> list[tuple[int, float]]:
    """The tokens emitted after verifying `draft`, with their logprobs.

    logprobs [k+1, V]: `token_logprobs` at the last emitted token and after each draft token;
    keep [k+1, V] the truncation masks (None = every token). Returns 1 to k + 1 tokens: the
    accepted draft prefix, then a correction (on a rejection) or a bonus token."""
    out: list[tuple[int, float]] = []
    no_greedy = torch.tensor([False])
    for i in range(len(draft) + 1):
        row = logprobs[i]
        allowed = None if keep is None else keep[i]
        if greedy:
            tok = int(row.argmax())
            out.append((tok, float(row[tok])))
            if i < len(draft) and tok == draft[i]:
                continue
            return out
        if i < len(draft):
            d = draft[i]
            probs = row.exp() if allowed is None else row.exp() * allowed
            p_d = float(probs[d] / probs.sum())
            u = float(torch.rand(1, generator=generator)[0])
            if u < p_d:
                out.append((d, float(row[d])))
                continue
            # rejected: sample from p with d removed (p - q, clipped, for a point-mass draft)
            residual = (torch.ones_like(row, dtype=torch.bool) if allowed is None
                        else allowed.clone())
            residual[d] = False
            if not bool(residual.any()):  # p(d) was 1: unreachable, as u < 1
                residual[d] = True
            tok = int(sample_tokens(row[None], no_greedy, residual[None], [generator])[0])
            out.append((tok, float(row[tok])))
            return out
        tok = int(sample_tokens(row[None], no_greedy, None if allowed is None else allowed[None],
                                [generator])[0])
        out.append((tok, float(row[tok])))
    return out
