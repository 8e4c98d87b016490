"""A seeded model of LLM serving traffic: the structured tensors of realistic kernel calls.

Request lengths come from a heavy-tailed mix (chat turns, long documents); batches carry the
awkward cases servers produce (empty and length-1 sequences, partly filled last pages,
non-aligned sizes, skewed expert routing, probability ties at the top-p boundary).
Everything is a pure function of the numpy Generator it is given; nothing here writes files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = [
    "PageTable", "RaggedBatch", "TIE_MARGIN", "decode_lengths", "mass_above", "page_table", "prefill_lengths",
    "ragged_indptr", "routing_logits", "routing_skew", "sampling_rows", "serving_lengths",
]

TIE_MARGIN = 1e-4
"""Least distance between top_p and any token's mass-above, so that fp32 sums cannot flip a verdict."""


def serving_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """n request lengths in [lo, hi]: 70% short chat turns, 30% long documents (log-normal each)."""
    long = rng.random(n) < 0.3
    mu = np.where(long, np.log(max(hi, 2)) - 0.5, np.log(max(np.sqrt(max(lo, 1) * hi), 2)))
    x = np.exp(rng.normal(mu, 0.6))
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def decode_lengths(rng: np.random.Generator, batch: int, lo: int, hi: int, edge_cases: bool) -> np.ndarray:
    """KV lengths of a decode batch; with edge_cases an empty and a length-1 sequence are included."""
    lens = serving_lengths(rng, batch, lo, hi)
    if edge_cases and batch >= 3:
        lens[rng.choice(batch, 2, replace=False)] = [0, 1]
    return lens


def prefill_lengths(rng: np.random.Generator, batch: int, q_lo: int, q_hi: int, prefix_hi: int,
                    edge_cases: bool) -> tuple[np.ndarray, np.ndarray]:
    """(q_len, kv_len) per sequence: new tokens and the cached prefix they extend (kv_len >= q_len).

    With edge_cases one sequence has no new tokens (but a prefix) and one has a single new token.
    """
    q = serving_lengths(rng, batch, q_lo, q_hi)
    prefix = np.where(rng.random(batch) < 0.5, 0, rng.integers(0, prefix_hi + 1, batch))
    if edge_cases and batch >= 3:
        i, j = rng.choice(batch, 2, replace=False)
        q[i], q[j] = 0, 1
        prefix[i] = max(prefix[i], 1)
    return q, q + prefix


@dataclass(frozen=True)
class PageTable:
    """A paged KV cache layout: CSR page lists of the sequences in a shuffled page pool."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    num_pages: int


def page_table(rng: np.random.Generator, kv_lens: Sequence[int], page_size: int, spare: float = 0.1) -> PageTable:
    """Pages for each sequence, drawn without replacement from a pool with `spare` unused pages.

    A sequence of n > 0 tokens holds ceil(n / page_size) pages, the last one holding
    n - (pages - 1) * page_size tokens (so usually partly filled); an empty one holds none.
    """
    lens = np.asarray(kv_lens, dtype=np.int64)
    pages = -(-lens // page_size)
    total = int(pages.sum())
    pool = max(total + int(np.ceil(total * spare)), 1)
    indices = rng.permutation(pool)[:total]
    last = np.where(lens > 0, lens - (pages - 1) * page_size, 0)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    return PageTable(
        kv_indptr=torch.from_numpy(indptr.astype(np.int32)),
        kv_indices=torch.from_numpy(indices.astype(np.int32)),
        kv_last_page_len=torch.from_numpy(last.astype(np.int32)),
        num_pages=pool,
    )


@dataclass(frozen=True)
class RaggedBatch:
    """CSR offsets of packed queries and keys."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor


def ragged_indptr(q_lens: Sequence[int], kv_lens: Sequence[int]) -> RaggedBatch:
    """Offsets of sequences packed back to back."""
    q = np.concatenate([[0], np.cumsum(np.asarray(q_lens, dtype=np.int64))])
    kv = np.concatenate([[0], np.cumsum(np.asarray(kv_lens, dtype=np.int64))])
    return RaggedBatch(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(kv.astype(np.int32)))


def routing_logits(rng: np.random.Generator, tokens: int, experts: int, zipf: float) -> torch.Tensor:
    """Router logits whose top-k choices follow a Zipf(zipf) expert popularity (0 = uniform)."""
    popularity = 1.0 / np.arange(1, experts + 1) ** zipf
    bias = np.log(popularity[rng.permutation(experts)])
    logits = bias[None, :] + rng.gumbel(size=(tokens, experts))
    return torch.from_numpy(logits.astype(np.float32))


def routing_skew(logits: torch.Tensor, top_k: int) -> float:
    """Load of the busiest expert over the mean load (1 = perfectly balanced)."""
    ids = torch.topk(logits.float(), top_k, dim=-1).indices.flatten()
    load = torch.bincount(ids, minlength=logits.shape[1]).double()
    return float(load.max() / load.mean()) if load.sum() > 0 else 1.0


def mass_above(row: np.ndarray) -> np.ndarray:
    """For each token, the total probability of the tokens strictly more probable (fp64)."""
    asc = np.sort(row.astype(np.float64))
    suffix = np.concatenate([np.cumsum(asc[::-1])[::-1], [0.0]])
    return suffix[np.searchsorted(asc, row.astype(np.float64), side="right")]


def _peaked_row(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """A next-token-like distribution: a head of 16-32 candidates decaying geometrically (ratio 0.85-0.95)
    holding 50-70% of the mass, then a long Zipfian tail; all values distinct, vocabulary shuffled."""
    head = int(rng.integers(16, 33))
    ratio = rng.uniform(0.85, 0.95)
    head_p = ratio ** np.arange(head) * np.exp(rng.normal(0, 0.01, head))
    head_p = np.sort(head_p)[::-1] * rng.uniform(0.5, 0.7) / head_p.sum()
    tail = 1.0 / np.arange(2, vocab - head + 2) ** rng.uniform(1.0, 1.3) * np.exp(rng.normal(0, 0.05, vocab - head))
    tail = tail * (1.0 - head_p.sum()) / tail.sum()
    tail = np.minimum(tail, head_p[-1] * 0.9)
    p = np.concatenate([head_p, tail])
    return (p / p.sum())[rng.permutation(vocab)]


def _tied_row(rng: np.random.Generator, vocab: int, head: int, tied: int, tied_mass: float) -> np.ndarray:
    """`head` distinct tokens, then `tied` tokens of exactly equal probability, then a tail below them
    holding about half of the mass (so a filter removes a lot)."""
    value = tied_mass / tied
    head_p = value * (1.3 + 0.4 * rng.random(head)) + np.arange(head)[::-1] * 1e-3
    rest = max(1.0 - head_p.sum() - tied_mass, 0.3)
    tail = np.minimum(rng.dirichlet(np.full(vocab - head - tied, 0.3)) * rest, value * 0.5)
    p = np.concatenate([head_p, np.full(tied, value), tail])
    return (p / p.sum())[rng.permutation(vocab)]


def _kept_by_top_k(p: np.ndarray, k: int) -> np.ndarray:
    """The tie-keeping top-k set: fewer than k tokens strictly more probable."""
    if k <= 0 or k >= p.size:
        return np.ones(p.size, dtype=bool)
    above = p.size - np.searchsorted(np.sort(p), p, side="right")
    return above < k


def sampling_rows(rng: np.random.Generator, vocab: int, batch: int, scenario: str,
                  kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [batch, vocab] fp32, top_k [batch] int32, top_p [batch] fp32) for a scenario and filter kind.

    plain: next-token-like rows, k in [4, 12], p in [0.3, 0.6] (the filter removes about half of
    the mass); with batch >= 4 the last row is unfiltered (k = 0, p = 1).
    ties: a group of 6 equal probabilities straddles the boundary of the filter `kind` uses:
    for top_k, k cuts the group; for top_p (and top_k_top_p, after top-k renormalisation), top_p
    falls between the group's 2nd and 3rd member, so a filter that keeps a sorted prefix of the
    group differs from the tie-keeping rule. top_p keeps TIE_MARGIN away from every token's
    mass-above, so that fp32 sums cannot flip a token in or out.
    """
    rows, ks, ps = [], [], []
    for r in range(batch):
        if scenario == "ties":
            head = int(rng.integers(2, 4))
            p = _tied_row(rng, vocab, head=head, tied=6, tied_mass=0.3).astype(np.float32)
            p = (p / p.sum(dtype=np.float64)).astype(np.float32)
            value = float(np.sort(p)[::-1][head])
            k = head + 2 if kind == "top_k" else int(rng.integers(head + 8, 48))
            z = float(p[_kept_by_top_k(p, k)].sum(dtype=np.float64)) if kind == "top_k_top_p" else 1.0
            h = float(np.sort(p)[::-1][:head].sum(dtype=np.float64))
            top_p = (h + value * (1.5 + 0.5 * rng.random())) / z if kind != "top_k" else 1.0
        elif scenario == "plain":
            p = _peaked_row(rng, vocab).astype(np.float32)
            p = (p / p.sum(dtype=np.float64)).astype(np.float32)
            last = r == batch - 1 and batch >= 4
            k = 0 if last else int(rng.integers(4, 13))
            top_p = 1.0 if last else float(rng.uniform(0.3, 0.6))
            z = float(p[_kept_by_top_k(p, k)].sum(dtype=np.float64)) if kind == "top_k_top_p" else 1.0
        else:
            raise ValueError(f"scenario: expected plain or ties, got {scenario!r}")
        if kind == "top_k_top_p":
            kept = _kept_by_top_k(p, k)
        else:
            kept = np.ones(vocab, dtype=bool)
        if top_p < 1.0:
            top_p = _clear_of_ties(mass_above(np.where(kept, p, 0)) / z, top_p)
        rows.append(p)
        ks.append(k)
        ps.append(top_p)
    return (torch.from_numpy(np.stack(rows)), torch.tensor(ks, dtype=torch.int32),
            torch.tensor(ps, dtype=torch.float32))


def _clear_of_ties(above: np.ndarray, top_p: float, margin: float = TIE_MARGIN) -> float:
    """Move top_p (as fp32) until no token's mass-above is within `margin` of it."""
    levels = np.unique(above)
    p = float(np.float32(top_p))
    for _ in range(1000):
        close = levels[np.abs(levels - p) < margin]
        if close.size == 0:
            return p
        p = float(np.float32(close.max() + 2 * margin))
    raise ValueError(f"cannot place top_p near {top_p} clear of the token masses")
