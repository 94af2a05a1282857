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
never above plain rounding's.
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
    sums = _GroupSums(x, g)
    best = sums.error(codes, scale, lo)
    low = x.amin(-1, keepdim=True)
    span = x.amax(-1, keepdim=True) - low
    unit = (x - low) * torch.where(span > 0, 1 / span, torch.zeros_like(span))  # 0..1 a group
    for step in INT4_STEPS:
        q = (unit * step).round_().clamp_(0, 15)
        gq = g * q
        sum_q, sum_q2, sum_xq = (_sum(t) for t in (gq, gq * q, gq * x))
        # Weighted least squares of x ~ s * q + m; D = 0 (one code in the group) gives inf or
        # nan, which never compares smaller below.
        det = sums.w * sum_q2 - sum_q * sum_q
        s = ((sums.w * sum_xq - sums.x * sum_q) / det).float()  # stored as float32: judged so
        m = ((sum_q2 * sums.x - sum_q * sum_xq) / det).float()
        err = sums.error_of(s, m, sum_q, sum_q2, sum_xq)
        better = err < best
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
        sums = _GroupSums(x, g)
        best = sums.error(c, scale[rows], torch.zeros_like(scale[rows]))
        unit = x / x.abs().amax(1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        for step in INT8_STEPS:
            q = (unit * step).round_().clamp_(-127, 127)
            gq = g * q
            sum_q, sum_q2, sum_xq = (_sum(t) for t in (gq, gq * q, gq * x))
            s = (sum_xq / sum_q2).float()  # symmetric: the weighted least squares scale
            err = sums.error_of(s, torch.zeros_like(s), sum_q, sum_q2, sum_xq)
            better = err < best  # a zero row's nan never is
            c = torch.where(better[:, None], q, c)
            scale[rows] = torch.where(better, s, scale[rows])
            best = torch.where(better, err, best)
        codes[rows] = c.to(torch.int8)
    return codes, scale


class _GroupSums:
    """The weighted sums of a group (the last dimension) that do not depend on the codes."""

    def __init__(self, x: torch.Tensor, g: torch.Tensor) -> None:
        self.g, self.x_in = g, x
        gx = g * x
        self.w = _sum(g.expand_as(x))
        self.x = _sum(gx)
        self.x2 = _sum(gx * x)

    def error(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        gq = self.g * codes
        return self.error_of(scale, lo, _sum(gq), _sum(gq * codes), _sum(gq * self.x_in))

    def error_of(
        self,
        s: torch.Tensor,
        m: torch.Tensor,
        sum_q: torch.Tensor,
        sum_q2: torch.Tensor,
        sum_xq: torch.Tensor,
    ) -> torch.Tensor:
        """sum g (s q + m - x)^2 from the sums (no tensor of the group's size), in float64."""
        s, m = s.double(), m.double()
        return (
            s * s * sum_q2
            + 2 * s * m * sum_q
            + m * m * self.w
            - 2 * s * sum_xq
            - 2 * m * self.x
            + self.x2
        )


def _sum(t: torch.Tensor) -> torch.Tensor:
    """A group's sum, as float64 for the error (a small difference of these)."""
    return t.sum(-1).double()


def _normalized(importance: torch.Tensor) -> torch.Tensor | None:
    """Float32 weights of mean 1 (the sums stay well scaled); None where no column carries any
    (a projection the calibration text never reached)."""
    weights = importance.double().clamp(min=0)
    mean = weights.mean()
    return (weights / mean).float() if mean > 0 else None


def _row_blocks(out_f: int, in_f: int) -> list[slice]:
    step = max(1, _BLOCK_ELEMENTS // in_f)
    return [slice(start, start + step) for start in range(0, out_f, step)]
