"""Deliberately wrong samplers: each one is a plausible bug that the sampling checker must catch.

unnormalized_*: draws u in [0, 1) instead of [0, kept mass) and gives the overflow to the least
probable kept token: biased (it gets all the filtered-out mass), never masked.
k_plus_one: keeps one token too many (count_above <= k): samples filtered-out tokens.
top_k_only: forgets top-p in top-k-then-top-p: samples filtered-out tokens.
sorted_*: keeps a sorted prefix (ties broken by position, as a sort-based reference does): differs
from the tie-keeping rule exactly when a group of equal probabilities straddles the boundary.
"""

import torch


def _sorted_filter(probs, top_k=None, top_p=None, k_slack=0):
    """The correct tie-keeping filter in sorted order (k_slack=1 keeps one token too many)."""
    vals, idx = torch.sort(probs, dim=-1, descending=True)
    n = vals.shape[-1]
    pos = torch.arange(n, device=probs.device).expand_as(vals)
    starts = torch.ones_like(vals, dtype=torch.bool)
    starts[:, 1:] = vals[:, 1:] != vals[:, :-1]
    group_start = torch.cummax(torch.where(starts, pos, 0), dim=-1).values
    keep = torch.ones_like(vals, dtype=torch.bool)
    if top_k is not None:
        k = top_k.long()[:, None]
        keep &= (k <= 0) | (k >= n) | (group_start < k + k_slack)
    if top_p is not None:
        kept = torch.where(keep, vals, 0.0)
        above = (kept.cumsum(-1) - kept).gather(1, group_start)
        keep &= (top_p[:, None] >= 1.0) | (above < top_p[:, None] * kept.sum(-1, keepdim=True)) | (group_start == 0)
    return vals, idx, keep


def _draw(vals, idx, keep, scale_u=True):
    cdf = torch.where(keep, vals, 0.0).cumsum(-1)
    u = torch.rand(vals.shape[0], 1, device=vals.device)
    if scale_u:
        u = u * cdf[:, -1:]
    j = torch.searchsorted(cdf, u, right=True)
    return idx.gather(1, torch.minimum(j, keep.sum(-1, keepdim=True) - 1)).squeeze(-1)


def _sorted_prefix(probs, top_k=None, top_p=None):
    """Keep the first k sorted positions, then those whose preceding cumulative mass is <= top_p (ties by position)."""
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    pos = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    keep = torch.ones_like(vals, dtype=torch.bool)
    if top_k is not None:
        k = top_k.long()[:, None]
        keep &= (k <= 0) | (k >= probs.shape[-1]) | (pos < k)
    if top_p is not None:
        v = torch.where(keep, vals, 0.0)
        v = v / v.sum(-1, keepdim=True)
        keep &= (top_p[:, None] >= 1.0) | (v.cumsum(-1) - v <= top_p[:, None])
    return vals, idx, keep


@torch.no_grad()
def unnormalized_top_k(probs, top_k):
    return _draw(*_sorted_filter(probs, top_k=top_k), scale_u=False)


@torch.no_grad()
def unnormalized_top_p(probs, top_p):
    return _draw(*_sorted_filter(probs, top_p=top_p), scale_u=False)


@torch.no_grad()
def k_plus_one(probs, top_k):
    return _draw(*_sorted_filter(probs, top_k=top_k, k_slack=1))


@torch.no_grad()
def top_k_only(probs, top_k, top_p):
    return _draw(*_sorted_filter(probs, top_k=top_k))


@torch.no_grad()
def sorted_top_k(probs, top_k):
    return _draw(*_sorted_prefix(probs, top_k=top_k))


@torch.no_grad()
def sorted_top_p(probs, top_p):
    return _draw(*_sorted_prefix(probs, top_p=top_p))


@torch.no_grad()
def sorted_top_k_top_p(probs, top_k, top_p):
    return _draw(*_sorted_prefix(probs, top_k, top_p))
