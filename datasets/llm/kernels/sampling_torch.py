"""Top-k / top-p sampling from probabilities in PyTorch: one descending sort, the filter in sorted order,
an inverse-CDF draw.

A token is kept when fewer than k tokens are strictly more probable (top-k) and when the strictly
more probable kept tokens hold less than top_p of the kept mass (top-p, after top-k
renormalisation); ties at a boundary are kept, and the most probable token always stays.
"""

import torch


def _sorted_filter(probs, top_k=None, top_p=None):
    """Descending values, their token ids, and which sorted positions the filter keeps."""
    vals, idx = torch.sort(probs, dim=-1, descending=True)
    n = vals.shape[-1]
    pos = torch.arange(n, device=probs.device).expand_as(vals)
    starts = torch.ones_like(vals, dtype=torch.bool)
    starts[:, 1:] = vals[:, 1:] != vals[:, :-1]
    group_start = torch.cummax(torch.where(starts, pos, 0), dim=-1).values  # = tokens strictly above
    keep = torch.ones_like(vals, dtype=torch.bool)
    if top_k is not None:
        k = top_k.long()[:, None]
        keep &= (k <= 0) | (k >= n) | (group_start < k)
    if top_p is not None:
        kept = torch.where(keep, vals, 0.0)
        above = (kept.cumsum(-1) - kept).gather(1, group_start)  # mass strictly above (a tie group shares it)
        total = kept.sum(-1, keepdim=True)
        keep &= (top_p[:, None] >= 1.0) | (above < top_p[:, None] * total) | (group_start == 0)
    return vals, idx, keep


def _draw(vals, idx, keep):
    cdf = torch.where(keep, vals, 0.0).cumsum(-1)
    u = torch.rand(vals.shape[0], 1, device=vals.device) * cdf[:, -1:]
    j = torch.searchsorted(cdf, u, right=True).clamp_(max=vals.shape[-1] - 1)
    last = keep.sum(-1, keepdim=True) - 1  # kept positions are a prefix of the sorted order
    return idx.gather(1, torch.minimum(j, last)).squeeze(-1)


@torch.no_grad()
def top_k_sampling(probs, top_k):
    return _draw(*_sorted_filter(probs.float(), top_k=top_k))


@torch.no_grad()
def top_p_sampling(probs, top_p):
    return _draw(*_sorted_filter(probs.float(), top_p=top_p))


@torch.no_grad()
def top_k_top_p_sampling(probs, top_k, top_p):
    return _draw(*_sorted_filter(probs.float(), top_k=top_k, top_p=top_p))
