"""Top-k / top-p sampling from probabilities in Triton, by sorting-free rejection (as FlashInfer does).

Each round draws a token j from the tokens above a pivot (inverse CDF over one pass of the
row), then counts the tokens strictly more probable than j and their mass: j is accepted when it
passes the filter (fewer than k above it, and less than top_p of the kept mass above it), else
the pivot rises to p_j and the next round draws among more probable tokens only. The accepted
token follows the filtered distribution exactly, with ties at a boundary kept. With both
filters, top-p applies after top-k renormalisation, so the top-k mass is found first by a
bisection on the float bits of the k-th largest probability.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(probs_ptr, rows, r_ok, V, c0, BLOCK_V: tl.constexpr):
    offs = c0 + tl.arange(0, BLOCK_V)
    x = tl.load(probs_ptr + rows[:, None] * V + offs[None, :], mask=r_ok[:, None] & (offs[None, :] < V), other=0.0)
    return x, offs


@triton.jit
def _row_sums(probs_ptr, rows, r_ok, V, thresh, x0, ONE_TILE: tl.constexpr, BLOCK_B: tl.constexpr,
              BLOCK_V: tl.constexpr):
    """Per row: number and mass of the tokens with p > thresh (thresh per row). x0 is the row when it fits one tile."""
    if ONE_TILE:
        gt = x0 > thresh[:, None]
        cnt = tl.sum(gt.to(tl.int32), axis=1)
        mass = tl.sum(tl.where(gt, x0, 0.0), axis=1)
    else:
        cnt = tl.zeros((BLOCK_B,), tl.int32)
        mass = tl.zeros((BLOCK_B,), tl.float32)
        for c0 in range(0, V, BLOCK_V):
            x, _ = _tile(probs_ptr, rows, r_ok, V, c0, BLOCK_V)
            gt = x > thresh[:, None]
            cnt += tl.sum(gt.to(tl.int32), axis=1)
            mass += tl.sum(tl.where(gt, x, 0.0), axis=1)
    return cnt, mass


@triton.jit
def _row_counts(probs_ptr, rows, r_ok, V, thresh, x0, ONE_TILE: tl.constexpr, BLOCK_B: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """Per row: number of tokens with p > thresh."""
    if ONE_TILE:
        cnt = tl.sum((x0 > thresh[:, None]).to(tl.int32), axis=1)
    else:
        cnt = tl.zeros((BLOCK_B,), tl.int32)
        for c0 in range(0, V, BLOCK_V):
            x, _ = _tile(probs_ptr, rows, r_ok, V, c0, BLOCK_V)
            cnt += tl.sum((x > thresh[:, None]).to(tl.int32), axis=1)
    return cnt


@triton.jit
def _inverse_cdf(probs_ptr, rows, r_ok, V, pivot, u, x0, ONE_TILE: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """Per row: the first token (in index order) among p > pivot whose running mass exceeds u."""
    pick = tl.full((BLOCK_B,), -1, tl.int64)
    last = tl.full((BLOCK_B,), -1, tl.int64)
    running = tl.zeros((BLOCK_B,), tl.float32)
    n_tiles = 1 if ONE_TILE else tl.cdiv(V, BLOCK_V)
    for i in range(0, n_tiles):
        if ONE_TILE:
            x, offs = x0, tl.arange(0, BLOCK_V)
        else:
            x, offs = _tile(probs_ptr, rows, r_ok, V, i * BLOCK_V, BLOCK_V)
        x = tl.where(x > pivot[:, None], x, 0.0)
        cs = tl.cumsum(x, axis=1) + running[:, None]
        first = tl.min(tl.where((cs > u[:, None]) & (x > 0), offs[None, :], V), axis=1).to(tl.int64)
        pick = tl.where((pick < 0) & (first < V), first, pick)
        last = tl.maximum(last, tl.max(tl.where(x > 0, offs[None, :], -1), axis=1).to(tl.int64))
        running += tl.sum(x, axis=1)
    return tl.where(pick < 0, last, pick)  # u rounded past the row's sum: the last candidate


@triton.jit
def _sample_kernel(probs_ptr, top_k_ptr, top_p_ptr, out_ptr, B, V, seed, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
                   ONE_TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    r_ok = rows < B
    rows64 = rows.to(tl.int64)
    zero = tl.zeros((BLOCK_B,), tl.float32)
    x0 = tl.zeros((BLOCK_B, BLOCK_V), tl.float32)
    if ONE_TILE:  # the whole row stays in registers for every pass
        x0, _ = _tile(probs_ptr, rows64, r_ok, V, 0, BLOCK_V)
    if HAS_K:
        k = tl.load(top_k_ptr + rows, mask=r_ok, other=0)
        k = tl.where((k > 0) & (k < V), k, V)  # k = V: no filter
    else:
        k = tl.full((BLOCK_B,), V, tl.int32)
    _n, total = _row_sums(probs_ptr, rows64, r_ok, V, zero - 1.0, x0, ONE_TILE, BLOCK_B, BLOCK_V)
    kept = total
    if HAS_K and HAS_P:
        # the k-th largest value by bisection on the bits of non-negative floats (ordered like ints):
        # lo ends as the largest float with count(p > lo) >= k, so mass(p > lo) is the top-k mass
        lo = tl.zeros((BLOCK_B,), tl.int32)
        hi = tl.full((BLOCK_B,), 0x7F800000, tl.int32)
        for _ in range(31):
            mid = lo + (hi - lo + 1) // 2
            n_gt = _row_counts(probs_ptr, rows64, r_ok, V, mid.to(tl.float32, bitcast=True), x0, ONE_TILE,
                               BLOCK_B, BLOCK_V)
            ge = n_gt >= k
            lo = tl.where(ge, mid, lo)
            hi = tl.where(ge, hi, mid - 1)
        _c, kept = _row_sums(probs_ptr, rows64, r_ok, V, lo.to(tl.float32, bitcast=True), x0, ONE_TILE,
                             BLOCK_B, BLOCK_V)
        kept = tl.where(k < V, kept, total)
    if HAS_P:
        top_p = tl.load(top_p_ptr + rows, mask=r_ok, other=1.0)
        cut = tl.where(top_p < 1.0, top_p * kept, float("inf"))
    else:
        cut = tl.full((BLOCK_B,), float("inf"), tl.float32)

    pivot = zero  # draw among p > pivot
    z = total  # mass above the pivot
    done = ~r_ok
    result = tl.zeros((BLOCK_B,), tl.int64)
    rnd = 0
    while tl.sum((~done).to(tl.int32), axis=0) > 0:
        u = tl.rand(seed, rows * 4096 + rnd) * z
        pick = _inverse_cdf(probs_ptr, rows64, r_ok, V, pivot, u, x0, ONE_TILE, BLOCK_B, BLOCK_V)
        active = ~done
        p_pick = tl.load(probs_ptr + rows64 * V + pick, mask=active & (pick >= 0), other=0.0)
        n_above, m_above = _row_sums(probs_ptr, rows64, active, V, p_pick, x0, ONE_TILE, BLOCK_B, BLOCK_V)
        accept = active & (((n_above < k) & (m_above < cut)) | (n_above == 0))
        result = tl.where(accept, pick, result)
        done = done | accept
        pivot = tl.where(done, pivot, p_pick)
        z = tl.where(done, z, m_above)
        rnd += 1
    tl.store(out_ptr + rows, result, mask=r_ok)


def _launch(probs, top_k, top_p, samples):
    batch, vocab = probs.shape
    if batch == 0:
        return
    if probs.is_cuda:
        block_b, block_v, warps = 1, 4096, 8
    else:  # the interpreter pays per op: many rows per program, the whole row in one tile
        block_v = triton.next_power_of_2(vocab)
        block_b = max(1, min(64, (1 << 20) // block_v, triton.next_power_of_2(batch)))
        warps = 4
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # from torch's CPU generator: no device sync
    _sample_kernel[(triton.cdiv(batch, block_b),)](
        probs, top_k if top_k is not None else probs, top_p if top_p is not None else probs, samples,
        batch, vocab, seed, HAS_K=top_k is not None, HAS_P=top_p is not None, ONE_TILE=vocab <= block_v,
        BLOCK_B=block_b, BLOCK_V=block_v, num_warps=warps)


def top_k_sampling(probs, top_k, samples):
    _launch(probs, top_k, None, samples)


def top_p_sampling(probs, top_p, samples):
    _launch(probs, None, top_p, samples)


def top_k_top_p_sampling(probs, top_k, top_p, samples):
    _launch(probs, top_k, top_p, samples)
