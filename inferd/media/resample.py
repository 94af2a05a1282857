"""Resampling audio to a model's rate: libswresample, through PyAV, with its defaults.

The method: libswresample's polyphase windowed-sinc filter (Kaiser window, beta 9; filter size
32; 1024 phases; cutoff at 0.97 of the lower Nyquist frequency), flushed at the end. The output
holds ``ceil(n * to_rate / from_rate)`` samples: what the flush gives, made exact for clips too
short for the filter to fill (their tail is zero-padded). Each channel is resampled on its own
(as a mono stream), so any channel count works. It is not the soxr resampler librosa uses, so
audio resampled here differs from librosa's in the last bits; audio already at the model's rate
is passed through untouched.
"""

from __future__ import annotations

import av
import numpy as np
import numpy.typing as npt

_BLOCK = 1 << 16  # samples per frame handed to the resampler


def resample(
    samples: npt.NDArray[np.float32], from_rate: int, to_rate: int
) -> npt.NDArray[np.float32]:
    """``[channels, n]`` at ``from_rate`` -> ``[channels, m]`` at ``to_rate`` (method above)."""
    if from_rate == to_rate:
        return samples
    return np.stack([_resample_channel(channel, from_rate, to_rate) for channel in samples])


def _resample_channel(
    channel: npt.NDArray[np.float32], from_rate: int, to_rate: int
) -> npt.NDArray[np.float32]:
    resampler = av.AudioResampler(format="fltp", layout="mono", rate=to_rate)
    pieces = []
    for start in range(0, channel.shape[0], _BLOCK):
        block = np.ascontiguousarray(channel[None, start : start + _BLOCK], dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(block, format="fltp", layout="mono")
        frame.sample_rate = from_rate
        pieces += [out.to_ndarray()[0] for out in resampler.resample(frame)]
    pieces += [out.to_ndarray()[0] for out in resampler.resample(None)]
    length = -(-channel.shape[0] * to_rate // from_rate)  # ceil, in integers
    out = np.zeros(length, np.float32)
    if pieces:
        joined = np.concatenate(pieces)[:length]
        out[: joined.shape[0]] = joined
    return out
