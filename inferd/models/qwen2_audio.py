"""Qwen2-Audio: a Whisper-style audio encoder (two GELU convolutions, the second of stride 2,
learned positions, pre-norm transformer layers, an average pool of 2, a final LayerNorm), a
linear projector, and the Qwen2 decoder of models/llama.py.

An audio clip reaches the decoder through ``encode_audio``: the window's log-mel features
(models/whisper_features.py) become one row per ``<|AUDIO|>`` placeholder of the prompt, which
the engine's runner writes over those tokens' embeddings, as for images. The encoder always
reads the whole padded window (its positions are fixed), but its attention ignores positions
past the clip, and only the clip's rows are kept, as transformers does. Submodule names follow
the checkpoints' (``audio_tower.layers.N.self_attn.q_proj``, ``multi_modal_projector.linear``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import AudioConfig, ModelConfig, ModelConfigError
from inferd.models.llama import LlamaForCausalLM


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)  # Whisper's
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x [n, T, d]; keep [n, 1, 1, T]: the keys each clip attends to."""
        n, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        # Scaled before the product, as the reference does (its rounding, not only its value).
        q = heads(self.q_proj(x) * self.head_dim**-0.5)
        out = F.scaled_dot_product_attention(
            q, heads(self.k_proj(x)), heads(self.v_proj(x)), attn_mask=keep, scale=1.0
        )
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.self_attn = AudioAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), keep)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """features [n, mels, 2 * positions], frames [n] (mel frames each clip covers) ->
        [n, positions / 2, d]."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)
        x = x + self.embed_positions.weight
        valid = (frames - 1) // 2 + 1  # positions after the stride-2 conv
        keep = torch.arange(x.shape[1], device=x.device)[None, :] < valid[:, None]
        keep = keep[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keep)
        x = F.avg_pool1d(x.transpose(1, 2), kernel_size=2, stride=2).transpose(1, 2)
        return self.layer_norm(x)


class AudioProjector(nn.Module):
    def __init__(self, cfg: AudioConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(cfg.hidden_size, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        if cfg.audio is None:
            raise ModelConfigError("a Qwen2-Audio model needs an audio config")
        self.audio_config = cfg.audio
        self.audio_tower = AudioEncoder(cfg.audio)
        self.multi_modal_projector = AudioProjector(cfg.audio, cfg.hidden_size)
        self.encoder_calls = 0

    @property
    def audio_token_id(self) -> int:
        return self.audio_config.audio_token_id

    def encode_audio(self, features: torch.Tensor, frames: Sequence[int]) -> list[torch.Tensor]:
        """Clips' windows ``[n, mels, frames]`` and the frames each covers -> each clip's
        embeddings ``[num_tokens(frames), hidden]`` in the decoder's dtype, in the order of its
        ``<|AUDIO|>`` tokens."""
        expected = self.audio_config.max_frames
        if features.shape[-1] != expected:
            raise ValueError(f"the audio encoder takes {expected} mel frames a clip")
        self.encoder_calls += 1
        dtype = self.audio_tower.layer_norm.weight.dtype
        counts = torch.tensor(list(frames), dtype=torch.long)
        rows = self.multi_modal_projector(self.audio_tower(features.to(dtype), counts))
        rows = rows.to(self.embed_tokens.weight.dtype)
        return [r[: AudioConfig.num_tokens(f)] for r, f in zip(rows, frames, strict=True)]
