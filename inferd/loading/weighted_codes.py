"""Quantization codes that minimise an importance-weighted squared error (ISQ with an imatrix).

Plain ISQ puts each int4 group on the grid of its own [min, max] (``linear.int4_codes``) and
each int8 row on the grid of its absolute maximum (``linear.int8_codes``). Given the importance
of each input column (the mean squared activation, loading/imatrix.py), the error that matters
is ``sum_j imp_j (w_j - w_q_j)^2``, and another grid often does better: a slightly finer one
that clips a column the activations barely drive, for the sake of the columns they drive hard.
As llama.cpp's ``make_qkx3_quants`` (Q4_1, Q4_K) and ``make_qx_quants`` (Q8_0, Q6_K) do with
``quant_weights``, each candidate grid step rounds the weights, the scale (and the group's
offset) are then fitted to those codes by weighted least squares, and the candidate with the
smallest weighted error wins. The plain grid is one of the candidates, so the weighted error is
never above plain rounding's (and a candidate must beat it by more than rounding noise).
"""

from __future__ import annotations

import torch

from inferd.layers.linear import INT4_GROUP, int4_codes, int8_codes

# Steps across a group's span tried for int4: llama.cpp's Q4_1 search (15 - 0.9 ... 15 + 0.9).
INT4_STEPS = tuple(15 + 0.1 * k for k in range(-9, 10))
# Steps across a row's absolute maximum tried for int8: up to clipping it to two thirds.
INT8_STEPS = tuple(127 * (1 + 0.05 * k) for k in range(11))
_BLOCK_ELEMENTS = 1 << 20  # rows searched at once: 4 MB a temporary


def int4_codes_weighted(
    w: torch.Tensor, importance: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear.int4_codes``' result (codes 0..15 [out, in] uint8, scale and min [out, in/32]
    float32) for the smallest ``importance``-weighted squared error; ``importance`` [in]."""
    codes, scale, lo = int4_codes(w)
    weights = _normalized(importance)
    if weights is None:
        return codes, scale, lo
    out_f, in_f = w.shape
    g = weights.reshape(1, in_f // INT4_GROUP, INT4_GROUP)
    for rows in _row_blocks(out_f, in_f):
        x = w[rows].float().reshape(-1, in_f // INT4_GROUP, INT4_GROUP)
        c, s, m = _int4_search(x, g, codes[rows].reshape(x.shape).float(), scale[rows], lo[rows])
        codes[rows], scale[rows], lo[rows] = c.reshape(-1, in_f).to(torch.uint8), s, m
    return codes, scale, lo


def _int4_search(
    x: torch.Tensor, g: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, groups, 32], weights g [1, groups, 32]; the plain fit to start from."""
    judge = _Judge(x, g)
    best = judge.error(codes * scale[..., None] + lo[..., None])
    low = x.amin(-1, keepdim=True)
    span = x.amax(-1, keepdim=True) - low
    unit = (x - low) * torch.where(span > 0, 1 / span, torch.zeros_like(span))  # 0..1 a group
    sum_w, sum_x = _sum(g.expand_as(x)), _sum(g * x)
    for step in INT4_STEPS:
        q = (unit * step).round_().clamp_(0, 15)
        gq = g * q
        sum_q, sum_q2, sum_xq = _sum(gq), _sum(gq * q), _sum(gq * x)
        # Weighted least squares of x ~ s * q + m; D = 0 (one code in the group) gives inf or
        # nan, which never compares smaller below.
        det = sum_w * sum_q2 - sum_q * sum_q
        s = ((sum_w * sum_xq - sum_x * sum_q) / det).float()  # stored as float32: judged so
        m = ((sum_q2 * sum_x - sum_q * sum_xq) / det).float()
        err = judge.error(q * s[..., None] + m[..., None])
        better = judge.improves(err, best)
        codes = torch.where(better[..., None], q, codes)
        scale, lo, best = (torch.where(better, a, b) for a, b in ((s, scale), (m, lo), (err, best)))
    return codes, scale, lo


def int8_codes_weighted(
    w: torch.Tensor, importance: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear.int8_codes``' result (int8 [out, in], per-row scales [out] float32, symmetric)
    for the smallest ``importance``-weighted squared error; ``importance`` [in]."""
    codes, scale = int8_codes(w)
    weights = _normalized(importance)
    if weights is None:
        return codes, scale
    g = weights[None, :]
    for rows in _row_blocks(*w.shape):
        x = w[rows].float()
        c = codes[rows].float()
        judge = _Judge(x, g)
        best = judge.error(c * scale[rows, None])
        unit = x / x.abs().amax(1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        for step in INT8_STEPS:
            q = (unit * step).round_().clamp_(-127, 127)
            gq = g * q
            s = (_sum(gq * x) / _sum(gq * q)).float()  # symmetric: the weighted least squares
            err = judge.error(q * s[:, None])
            better = judge.improves(err, best)
            c = torch.where(better[:, None], q, c)
            scale[rows] = torch.where(better, s, scale[rows])
            best = torch.where(better, err, best)
        codes[rows] = c.to(torch.int8)
    return codes, scale


class _Judge:
    """The weighted squared error of a group's (the last dimension's) approximation, summed
    term by term: expanding it into sums of the codes would cancel catastrophically where a
    heavy column's weight is near zero while the group's offset is not."""

    def __init__(self, x: torch.Tensor, g: torch.Tensor) -> None:
        self.x, self.g = x, g
        self.energy = (g * x.square()).sum(-1)

    def error(self, approx: torch.Tensor) -> torch.Tensor:
        return (self.g * (approx - self.x).square()).sum(-1)

    def improves(self, err: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        """Where ``err`` beats ``best`` by more than rounding (a millionth of the group's
        weighted sum of squares): a fit as good stays, so weights already on a 4-bit grid (a
        GGUF's Q4_0/Q4_1 groups) keep their exact one. nan (no fit) never improves."""
        return err < best - 1e-6 * self.energy


def _sum(t: torch.Tensor) -> torch.Tensor:
    """A group's sum in float64, for the least squares (differences of these)."""
    return t.sum(-1, dtype=torch.float64)


def _normalized(importance: torch.Tensor) -> torch.Tensor | None:
    """Float32 weights of mean 1 (the sums stay well scaled); None where no column carries any
    (a projection the calibration text never reached)."""
    weights = importance.double().clamp(min=0)
    mean = weights.mean()
    return (weights / mean).float() if mean > 0 else None


def _row_blocks(out_f: int, in_f: int) -> list[slice]:
    step = max(1, _BLOCK_ELEMENTS // in_f)
    return [slice(start, start + step) for start in range(0, out_f, step)]
