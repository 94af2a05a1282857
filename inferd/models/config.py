"""The shape of a decoder-only transformer, read from GGUF metadata or a HF config.json."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from inferd.layers.rotary import RopeScaling

# Architectures whose GGUF layout is the Llama one (same tensor names, same blocks).
LLAMA_FAMILY = frozenset({"llama", "mistral"})

ACTIVATIONS = ("silu", "gelu_tanh")


class ModelConfigError(ValueError):
    """The model file describes something inferd cannot run; the message says what."""


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A SigLIP-style vision encoder and the connector into the text model (Idefics3)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # a tile's side in pixels
    patch_size: int
    layer_norm_eps: float
    scale_factor: int  # the pixel shuffle's factor: scale^2 patches become one token
    image_token_id: int  # the placeholder token the encoder's rows replace
    hidden_act: str = "gelu_tanh"
    num_channels: int = 3
    # Gemma 3: an average pool of scale x scale patches (not a pixel shuffle), and an image's
    # placeholder tokens attend to each other both ways in the decoder.
    pooled: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(
                f"vision hidden size {self.hidden_size} is not a multiple of {self.num_heads} heads"
            )
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ModelConfigError(
                f"vision tiles of {self.image_size} px in {self.patch_size} px patches cannot be "
                f"shuffled by {self.scale_factor}"
            )

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2

    @property
    def bidirectional(self) -> bool:
        """Whether an image's placeholder tokens attend to each other both ways in the
        decoder (Gemma 3, the one pooled encoder)."""
        return self.pooled


@dataclass(frozen=True, slots=True)
class AudioConfig:
    """A Whisper-style audio encoder (conv stem, pre-norm transformer, average pool of 2) and
    the linear projector into the text model (Qwen2-Audio)."""

    num_mel_bins: int
    hidden_size: int  # d_model
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_source_positions: int  # positions after the stride-2 conv: mel frames / 2
    audio_token_id: int  # the placeholder token the encoder's rows replace
    hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(
                f"audio hidden size {self.hidden_size} is not a multiple of {self.num_heads} heads"
            )

    @property
    def max_frames(self) -> int:
        """Mel frames of one window (the encoder takes exactly this many)."""
        return 2 * self.max_source_positions

    @staticmethod
    def num_tokens(frames: int) -> int:
        """Rows of a clip covering ``frames`` mel frames: after the stride-2 conv and the
        pool of 2 (the processor's count of ``<|AUDIO|>`` tokens)."""
        return ((frames - 1) // 2 + 1 - 2) // 2 + 1


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision encoder (3D patch embedding, 2D rotary, windowed attention with a
    few full-attention blocks, RMSNorm + SwiGLU blocks, a 2x2 patch merger) and its tokens."""

    hidden_size: int
    intermediate_size: int
    num_layers: int  # depth
    num_heads: int
    out_hidden_size: int  # the merger's output: the text model's width
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int  # a window's side in pixels
    fullatt_block_indexes: tuple[int, ...]
    tokens_per_second: float  # video: temporal positions per second of a temporal patch
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    rope_theta: float = 10000.0
    in_channels: int = 3
    # Qwen3-VL: blocks whose output, merged by a merger of its own, is added to the hidden
    # states of decoder layers 0, 1, ... at the media's positions ("deep stack").
    deepstack_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0  # Qwen3-VL: a learned square position grid, resampled
    hidden_act: str = "silu"  # the blocks' MLP: silu (gated, Qwen2.5-VL) or gelu_tanh

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ModelConfigError(
                f"vision hidden size {self.hidden_size} over {self.num_heads} heads cannot "
                "rotate in two axes"
            )

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP (layers/moe.py): per token, a router's softmax over
    ``num_experts`` picks the ``top_k`` likeliest, whose weights are renormalized to sum to
    one, and the token's output is their gated MLPs' outputs (``intermediate_size`` wide each)
    so weighted. Qwen3-VL-MoE puts it in place of the dense MLP of ``layers``; Gemma 4 beside
    it, in every layer."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    layers: tuple[int, ...]  # the decoder layers that have it

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ModelConfigError(
                f"{self.top_k} experts a token out of {self.num_experts} is not a routing"
            )
        if self.intermediate_size <= 0:
            raise ModelConfigError(f"expert intermediate size {self.intermediate_size}")


@dataclass(frozen=True, slots=True)
class Gemma4Layers:
    """What Gemma 4's decoder adds to Gemma 3's shape (models/gemma4.py): its global layers'
    own head size and key/value heads, values read from the keys' projection there
    (``k_eq_v``), the last layers reusing an earlier layer's keys and values, and per-layer
    embeddings (PLE) added after each layer's MLP."""

    global_head_dim: int
    global_kv_heads: int
    k_eq_v: bool  # global layers: no v_proj, the values are the keys' projection
    kv_shared_layers: int  # the last this many layers attend to an earlier layer's K/V
    per_layer_size: int  # PLE width per layer; 0: none
    per_layer_vocab: int
    double_wide_mlp: bool  # the K/V-sharing layers' MLPs are twice as wide
    global_rotary_fraction: float  # proportional RoPE: channels of a global head that rotate
    pad_token_id: int  # the PLE row of media placeholders


@dataclass(frozen=True, slots=True)
class Gemma3nMediaVocab:
    """A range of Gemma 3n's vocabulary (its image or audio markers and soft-token ids) whose
    embeddings come from that encoder's own small table, normed and projected into the text
    model (``embed_vision`` / ``embed_audio``), not from the text embedding."""

    name: str  # the checkpoint's module: embed_vision | embed_audio
    offset: int  # the first id
    size: int  # ids in the range
    hidden_size: int  # the table's width
    rms_norm_eps: float


@dataclass(frozen=True, slots=True)
class Gemma3nLayers:
    """What Gemma 3n's decoder (models/gemma3n.py) adds to the parts it shares with Gemma 4
    (PLE and K/V sharing, read from ``ModelConfig.gemma4``): AltUp's parallel streams, the
    Laurel low-rank branch, per-layer MLP widths and the gaussian top-k sparsity of the first
    layers' MLP gates. ``source_layers`` maps each of our layers to the checkpoint layer whose
    weights it reads (a MatFormer slice drops some, loading/matformer.py)."""

    altup_inputs: int  # streams: the active one plus its predicted companions
    altup_active: int  # the stream the layer runs on
    altup_correct_scale: bool  # the corrected active stream is scaled before the PLE gate
    laurel_rank: int
    intermediate_sizes: tuple[int, ...]  # each layer's MLP width
    sparsity: tuple[float, ...]  # each layer's target sparsity of its MLP gate; 0: dense
    source_layers: tuple[int, ...]  # the checkpoint layer of each of ours
    source_num_layers: int  # layers in the checkpoint (its PLE tables hold as many blocks)
    unserved_media: tuple[str, ...] = ()  # the checkpoint's encoders we do not run (image)
    media_vocab: tuple[Gemma3nMediaVocab, ...] = ()  # ids embedded by an encoder's table


@dataclass(frozen=True, slots=True)
class Gemma3nVisionConfig:
    """Gemma 3n's image encoder (models/gemma3n_vision.py): timm's ``mobilenetv5_300m_enc``,
    which transformers builds from ``vision_config`` (its ``model_args`` may scale the
    channels and set the fused resolution), then ``embed_vision``'s soft path. An image
    stands in the prompt as ``soft_tokens`` image tokens, its fused features' grid."""

    channel_multiplier: float  # scales every stage's channels (not the stem's below 1)
    output_resolution: int  # msfa_output_resolution: the fused grid's side
    hidden_size: int  # the fusion adapter's width (embed_vision's input)
    soft_tokens: int  # vision_soft_tokens_per_image
    image_token_id: int


@dataclass(frozen=True, slots=True)
class Gemma3nAudioConfig:
    """Gemma 3n's audio encoder (models/gemma3n_audio.py, transformers' Gemma3nAudioEncoder: a
    Universal Speech Model conformer): two conv blocks over the log-mel frames (each normed by a
    cumulative group norm), conformer layers with chunked local attention (relative positions,
    soft-capped logits), a light causal conv and two half-weighted feed-forwards, then every
    ``reduction``-th row, projected by ``embed_audio``. A clip stands in the prompt as
    ``soft_tokens`` audio tokens whatever its length: rows past its own are padding's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    mel_bins: int  # input_feat_size
    conv_channels: tuple[int, int]  # sscp_conv_channel_size
    conv_kernels: tuple[tuple[int, int], tuple[int, int]]  # (time, frequency) per block
    conv_strides: tuple[tuple[int, int], tuple[int, int]]
    group_norm_eps: float
    lconv_kernel_size: int  # conf_conv_kernel_size: the light conv's (causal, depthwise)
    residual_weight: float  # a feed-forward's output is scaled by this before its add
    chunk_size: int
    context_left: int  # a frame sees this many frames back, itself included
    context_right: int  # and this many ahead
    logit_cap: float
    reduction: int  # conf_reduction_factor: every this-th row of the conformer's output
    gradient_clipping: float
    rms_norm_eps: float
    soft_tokens: int  # audio_soft_tokens_per_image: the audio tokens of any clip
    audio_token_id: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(
                f"audio hidden size {self.hidden_size} is not a multiple of {self.num_heads} heads"
            )

    def num_rows(self, frames: int) -> int:
        """Encoder rows of a clip of ``frames`` mel frames: after the two convolutions (each
        padded by ``kernel - 1`` frames after the clip: ``ceil(frames / stride)`` rows) and the
        reduction."""
        for stride, _ in self.conv_strides:
            frames = -(-frames // stride)
        return -(-frames // self.reduction)


@dataclass(frozen=True, slots=True)
class Gemma4VisionConfig:
    """Gemma 4's image encoder (models/gemma4_vision.py): patches of any image shape with
    learned 2-D position tables and 2-D RoPE, Gemma 4-style layers, a ``pooling x pooling``
    average of the patch grid per soft token, and the projection into the text model."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling: int  # pooling_kernel_size: one soft token per pooling^2 patches
    position_table_size: int  # positions of each axis the learned table holds
    rms_norm_eps: float
    rope_theta: float
    standardize: bool  # the pooled features are shifted and scaled (std_bias, std_scale)
    clipped_linears: bool  # each projection clamps its input and output to stored bounds
    image_token_id: int
    video_token_id: int
    bidirectional: bool  # an image's soft tokens see each other both ways (sliding layers)

    def __post_init__(self) -> None:
        if self.head_dim % 4:
            raise ModelConfigError(f"vision head size {self.head_dim} cannot rotate in two axes")

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2


@dataclass(frozen=True, slots=True)
class Gemma4AudioConfig:
    """Gemma 4's audio encoder (models/gemma4_audio.py): two stride-2 conv blocks over the
    log-mel frames, conformer layers with chunked local attention (relative positions,
    soft-capped logits), a light causal conv and two half-weighted feed-forwards, an output
    projection and the projection into the text model: one row per 40 ms of audio."""

    hidden_size: int
    num_layers: int
    num_heads: int
    conv_channels: tuple[int, int]  # subsampling_conv_channels; the first is the mel bins
    conv_kernel_size: int  # the light conv's (causal, depthwise)
    residual_weight: float  # a feed-forward's output is scaled by this before its add
    chunk_size: int
    context_left: int  # a frame sees this many frames back, itself included
    context_right: int  # and this many ahead
    logit_cap: float
    invalid_logit: float  # the logit of a key a frame may not see
    clipped_linears: bool
    rms_norm_eps: float
    gradient_clipping: float
    output_dims: int  # output_proj_dims
    audio_token_id: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(
                f"audio hidden size {self.hidden_size} is not a multiple of {self.num_heads} heads"
            )

    @staticmethod
    def num_tokens(frames: int) -> int:
        """Rows of a clip of ``frames`` mel frames: after the two stride-2 convolutions."""
        for _ in range(2):
            frames = (frames - 1) // 2 + 1
        return frames


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position: int
    tie_word_embeddings: bool
    # Features beyond Llama; the defaults are Llama's.
    attention_bias: bool = False  # Qwen2: biases on the q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    rotary_dim: int | None = None  # partial rotary (Phi-3 family); None: the whole head
    sliding_window: int | None = None  # keys visible to a sliding-window layer (itself included)
    sliding_layers: tuple[int, ...] = ()  # the layers that use it
    attn_softcap: float | None = None  # Gemma 2: tanh soft-capping of attention scores
    final_softcap: float | None = None  # Gemma 2: tanh soft-capping of the logits
    attention_scale: float | None = None  # None: head_dim ** -0.5
    hidden_act: str = "silu"  # silu (SwiGLU) | gelu_tanh (GeGLU)
    # Gemma 3: sliding-window layers rotate with their own base (None: ``rope_theta``).
    rope_local_theta: float | None = None
    vision: VisionConfig | None = None  # an image encoder feeds the decoder (Idefics3)
    audio: AudioConfig | None = None  # an audio encoder feeds the decoder (Qwen2-Audio)
    qwen_vision: QwenVisionConfig | None = None  # Qwen2.5-VL's image and video encoder
    # M-RoPE (Qwen2.5-VL): rotary pairs split into temporal/height/width sections, each turned
    # by its own position id; None: one position per token.
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL: the sections interleave (pair j turned by axis j % 3 while that axis has pairs
    # left) rather than run one after another.
    mrope_interleaved: bool = False
    # Gemma 4's per-layer shapes and embeddings (Gemma 3n's PLE and K/V sharing too)
    gemma4: Gemma4Layers | None = None
    gemma3n: Gemma3nLayers | None = None  # Gemma 3n: AltUp, Laurel, MLP widths, sparsity
    moe: MoeConfig | None = None  # sparse mixture-of-experts MLPs (Qwen3-VL-MoE, Gemma 4)
    gemma4_vision: Gemma4VisionConfig | None = None  # Gemma 4's image (and video) encoder
    gemma4_audio: Gemma4AudioConfig | None = None  # Gemma 4's audio encoder
    gemma3n_audio: Gemma3nAudioConfig | None = None  # Gemma 3n's audio encoder
    gemma3n_vision: Gemma3nVisionConfig | None = None  # Gemma 3n's image encoder

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"{self.num_heads} attention heads cannot be grouped over "
                f"{self.num_kv_heads} key/value heads"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(
                f"activation {self.hidden_act!r} is not supported (supported: "
                f"{', '.join(ACTIVATIONS)})"
            )
        if self.rotary_dim is not None and not 0 < self.rotary_dim <= self.head_dim:
            raise ModelConfigError(f"rotary_dim {self.rotary_dim} outside 1..{self.head_dim}")
        if self.sliding_layers and self.sliding_window is None:
            raise ModelConfigError("sliding_layers without a sliding_window")

    def placeholder_token(self, modality: str) -> int | None:
        """The token whose embeddings an encoder of ``modality`` replaces; None without one."""
        if modality == "image" and self.vision is not None:
            return self.vision.image_token_id
        if modality == "audio" and self.audio is not None:
            return self.audio.audio_token_id
        if self.gemma4_audio is not None and modality == "audio":
            return self.gemma4_audio.audio_token_id
        if self.gemma3n_audio is not None and modality == "audio":
            return self.gemma3n_audio.audio_token_id
        if self.gemma3n_vision is not None and modality == "image":
            return self.gemma3n_vision.image_token_id
        if self.gemma4_vision is not None and modality in ("image", "video"):
            g = self.gemma4_vision
            return g.image_token_id if modality == "image" else g.video_token_id
        if self.qwen_vision is not None and modality in ("image", "video"):
            q = self.qwen_vision
            return q.image_token_id if modality == "image" else q.video_token_id
        return None

    @property
    def input_modalities(self) -> tuple[str, ...]:
        """What the model reads: text, and the media its encoders take."""
        media = ("image", "video", "audio")
        return ("text", *(m for m in media if self.placeholder_token(m) is not None))

    def window_of(self, layer: int) -> int | None:
        """The sliding window of one layer, or None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def uniform_window(self) -> int | None:
        """The sliding window when every layer uses it (then the KV cache may drop what falls
        behind it), else None."""
        every = len(self.sliding_layers) == self.num_layers
        return self.sliding_window if every and self.sliding_window is not None else None

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(key/value heads, head size) of one layer's cache: Gemma 4's global layers differ."""
        g = self.gemma4
        if g is not None and self.window_of(layer) is None:
            return g.global_kv_heads, g.global_head_dim
        return self.num_kv_heads, self.head_dim

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values ``layer`` attends to: itself, except Gemma 4's last
        ``kv_shared_layers``, which read the last earlier layer of their kind (sliding or
        global). -1 when every layer shares: they read another model's cache (Gemma 4's
        drafting assistant, models/gemma4_assistant.py)."""
        g = self.gemma4
        first_shared = self.num_layers - (g.kv_shared_layers if g is not None else 0)
        if layer < first_shared:
            return layer
        if first_shared == 0:
            return -1
        sliding = self.window_of(layer) is not None
        for source in range(first_shared - 1, -1, -1):
            if (self.window_of(source) is not None) == sliding:
                return source
        raise ModelConfigError(f"layer {layer} shares the K/V of no earlier layer of its kind")

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, in float32 (halve for 16-bit)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


# GGUF architectures (``general.architecture``) we read, in llama.cpp's layout for each.
GGUF_ARCHITECTURES = frozenset({*LLAMA_FAMILY, "qwen2", "qwen3", "gemma2", "gemma3", "phi3"})

# Gemma 3 interleaves five sliding-window layers with one global layer.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def gguf_key(meta: Mapping[str, Any], arch: str, name: str, default: Any = None) -> Any:
    """A GGUF file's metadata ``{arch}.{name}``, else ``default``; ModelConfigError when it
    is absent with no default."""
    value = meta.get(f"{arch}.{name}", default)
    if value is None:
        raise ModelConfigError(f"GGUF metadata lacks {arch}.{name}")
    return value


def config_from_gguf(meta: Mapping[str, Any], *, has_output_tensor: bool) -> ModelConfig:
    arch = str(meta.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise ModelConfigError(
            f"GGUF architecture {arch!r} is not supported yet (supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))})"
        )

    key = functools.partial(gguf_key, meta, arch)
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    layers = int(key("block_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if arch in LLAMA_FAMILY:  # llama.cpp's Llama writes the head size as the rotary size
        head_dim = int(rope_dims or hidden // heads)
    else:
        head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rotary_dim = int(rope_dims) if rope_dims and int(rope_dims) < head_dim else None
    raw_window = meta.get(f"{arch}.attention.sliding_window")
    window = int(raw_window) if raw_window is not None else None
    sliding: tuple[int, ...] = ()
    if window is not None and arch == "gemma2":  # llama.cpp: sliding on even layers
        sliding = tuple(range(0, layers, 2))
    elif window is not None and arch == "phi3":
        sliding = tuple(range(layers))
    elif window is not None and arch == "gemma3":
        sliding = _gemma3_sliding(meta, layers)
    gemma = arch == "gemma2"
    gemma_family = arch in ("gemma2", "gemma3")
    # llama.cpp scales Gemma queries by 1/sqrt(head size), except for the 27Bs (Gemma 2: 46
    # layers, Gemma 3: 62), whose query_pre_attn_scalar is hidden / heads.
    big = layers == (46 if arch == "gemma2" else 62)
    gemma_scale = (hidden / heads if big else head_dim) ** -0.5
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        max_position=int(key("context_length", 2048)),
        tie_word_embeddings=not has_output_tensor,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        rotary_dim=rotary_dim,
        sliding_window=window if sliding else None,
        sliding_layers=sliding,
        attn_softcap=_float_or_none(meta.get(f"{arch}.attn_logit_softcapping")) if gemma else None,
        final_softcap=_float_or_none(meta.get(f"{arch}.final_logit_softcapping"))
        if gemma
        else None,
        attention_scale=gemma_scale if gemma_family else None,
        hidden_act="gelu_tanh" if gemma_family else "silu",
        rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
        if arch == "gemma3"
        else None,
    )


def _gemma3_sliding(meta: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Gemma 3's sliding layers: from ``sliding_window_pattern`` when the file has it (newer
    converters write one bool per layer), else every layer but each sixth, as llama.cpp does."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise ModelConfigError(f"gemma3 sliding_window_pattern has {len(pattern)} entries")
        return tuple(i for i, sliding in enumerate(pattern) if sliding)
    period = int(pattern) if pattern is not None else GEMMA3_SLIDING_PATTERN
    return tuple(i for i in range(layers) if (i + 1) % period != 0)


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return RopeScaling()
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor, original_max_position=original)
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=factor, original_max_position=original)
    raise ModelConfigError(f"rope scaling type {kind!r} is not supported")


# --- Hugging Face config.json ------------------------------------------------------------------

# config.json ``model_type`` -> our architecture name (the decoder and the weight layout).
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "phi3": "phi3",
    "idefics3": "idefics3",  # SmolVLM: a Llama text model under a SigLIP-style image encoder
    "smolvlm": "smolvlm",  # SmolVLM2: the same model and image processor (video aside)
    "qwen2_audio": "qwen2_audio",  # a Qwen2 text model under a Whisper-style audio encoder
    "qwen2_5_vl": "qwen2_5_vl",  # a Qwen2 text model (M-RoPE) under an image/video encoder
    "qwen3_vl": "qwen3_vl",  # a Qwen3 text model (interleaved M-RoPE, deep stack) likewise
    "qwen3_vl_moe": "qwen3_vl",  # the same with mixture-of-experts MLPs (``ModelConfig.moe``)
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # Gemma3ForConditionalGeneration: a SigLIP encoder over Gemma 3 text
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",  # Gemma4ForConditionalGeneration: Gemma 4 text under its encoders
    "gemma3n_text": "gemma3n",
    "gemma3n": "gemma3n",  # Gemma3nForConditionalGeneration: text and audio (no image encoder)
}

# Architectures whose decoder takes an image encoder's rows (models/idefics3.py runs them all).
VISION_ARCHITECTURES = frozenset({"idefics3", "smolvlm"})

# Architectures whose decoder takes an audio encoder's rows (models/qwen2_audio.py).
AUDIO_ARCHITECTURES = frozenset({"qwen2_audio"})

# Qwen2.5-VL: a Qwen2 decoder with M-RoPE under an image and video encoder (models/qwen2_5_vl.py).
QWEN_VL_ARCHITECTURES = frozenset({"qwen2_5_vl"})

# Qwen3-VL: a Qwen3 decoder with interleaved M-RoPE fed at its first layers by the encoder's
# deep-stack rows (models/qwen3_vl.py); Qwen3-VL-MoE's MLPs are mixtures of experts.
QWEN3_VL_ARCHITECTURES = frozenset({"qwen3_vl", "qwen3_vl_moe"})

# The class transformers names in ``architectures`` for each of ours (written by convert).
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

_HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


def config_from_hf(hf: Mapping[str, Any], *, has_lm_head: bool = True) -> ModelConfig:
    """Our config from a transformers ``config.json`` (v4 and v5 spellings of RoPE settings).

    ``has_lm_head``: whether the checkpoint holds ``lm_head.weight``; without it the output
    projection is the embedding, whatever the config says.
    """
    model_type = str(hf.get("model_type", ""))
    if model_type in VISION_ARCHITECTURES:
        return _idefics3_from_hf(hf, has_lm_head)
    if model_type in AUDIO_ARCHITECTURES:
        return _qwen2_audio_from_hf(hf, has_lm_head)
    if model_type in QWEN_VL_ARCHITECTURES:
        return _qwen2_5_vl_from_hf(hf, has_lm_head)
    if model_type in QWEN3_VL_ARCHITECTURES:
        return _qwen3_vl_from_hf(hf, has_lm_head)
    if model_type == "gemma3":
        return _gemma3_vision_from_hf(hf, has_lm_head)
    if model_type in ("gemma4", "gemma4_text"):
        return _gemma4_from_hf(hf, has_lm_head)
    if model_type in ("gemma3n", "gemma3n_text"):
        return _gemma3n_from_hf(hf, has_lm_head)
    if model_type == "gemma3_text":
        hf = {**GEMMA3_TEXT_DEFAULTS, **hf}
    arch = HF_MODEL_TYPES.get(model_type)
    if arch is None:
        raise ModelConfigError(
            f"config.json model_type {model_type!r} is not supported (supported: "
            f"{', '.join(sorted(HF_MODEL_TYPES))})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = hf.get(name, default)
        if value is None:
            raise ModelConfigError(f"config.json lacks {name}")
        return value

    hidden = int(key("hidden_size"))
    heads = int(key("num_attention_heads"))
    layers = int(key("num_hidden_layers"))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    rope = _hf_rope(hf)
    act_name = str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu")
    act = _HF_ACTIVATIONS.get(act_name)
    if act is None:
        raise ModelConfigError(f"config.json activation {act_name!r} is not supported")
    for flag in ("mlp_bias",) + (("attention_bias",) if arch != "qwen2" else ()):
        if hf.get(flag):
            raise ModelConfigError(f"config.json {flag}: true is not supported for {model_type}")
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial) if partial != 1.0 else None
    window, sliding = _hf_sliding(hf, arch, layers)
    gemma = arch == "gemma2"
    gemma_family = arch in ("gemma2", "gemma3")
    global_rope, local_theta = rope, None
    if arch == "gemma3":
        global_rope, local_theta = _gemma3_rope(hf, rope)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(key("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(key("intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(global_rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_hf_rope_scaling(global_rope),
        max_position=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma_family)) or not has_lm_head,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        rotary_dim=rotary_dim,
        sliding_window=window,
        sliding_layers=sliding,
        attn_softcap=_float_or_none(hf.get("attn_logit_softcapping")) if gemma else None,
        final_softcap=_float_or_none(hf.get("final_logit_softcapping")) if gemma else None,
        attention_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5
        if gemma_family
        else None,
        hidden_act=act,
        rope_local_theta=local_theta,
    )


# transformers' Gemma3TextConfig defaults: the published config.json leaves most keys out.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
}


def _gemma3_rope(hf: Mapping[str, Any], rope: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's global-layer RoPE settings and its sliding layers' base: transformers v5
    nests them per layer type in ``rope_parameters``; v4 has ``rope_theta``, ``rope_scaling``
    (global layers only) and ``rope_local_base_freq``."""
    if isinstance(rope.get("full_attention"), Mapping):
        local = rope.get("sliding_attention") or {}
        theta = float(local.get("rope_theta", GEMMA3_LOCAL_ROPE_BASE))
        return dict(rope["full_attention"]), theta
    global_rope = {**rope, "rope_theta": float(hf.get("rope_theta", 1_000_000.0))}
    return global_rope, float(hf.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_BASE))


_VISION_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


def _idefics3_from_hf(hf: Mapping[str, Any], has_lm_head: bool) -> ModelConfig:
    """Idefics3 and SmolVLM: the Llama ``text_config`` with the ``vision_config`` encoder."""
    arch = str(hf["model_type"])
    text, vision = hf.get("text_config"), hf.get("vision_config")
    if not isinstance(text, Mapping) or not isinstance(vision, Mapping):
        raise ModelConfigError(f"config.json of {arch} needs text_config and vision_config")
    if text.get("model_type", "llama") != "llama":
        raise ModelConfigError(
            f"{arch} with a {text.get('model_type')!r} text model is not supported (llama)"
        )
    tied = bool(hf.get("tie_word_embeddings", False))
    decoder = config_from_hf(
        {**text, "model_type": "llama", "tie_word_embeddings": tied}, has_lm_head=has_lm_head
    )
    act = _VISION_ACTIVATIONS.get(str(vision.get("hidden_act", "gelu_pytorch_tanh")))
    if act is None:
        raise ModelConfigError(f"vision activation {vision.get('hidden_act')!r} is not supported")

    def key(name: str) -> Any:
        value = vision.get(name)
        if value is None:
            raise ModelConfigError(f"config.json vision_config lacks {name}")
        return value

    encoder = VisionConfig(
        hidden_size=int(key("hidden_size")),
        intermediate_size=int(key("intermediate_size")),
        num_layers=int(key("num_hidden_layers")),
        num_heads=int(key("num_attention_heads")),
        image_size=int(key("image_size")),
        patch_size=int(key("patch_size")),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
        scale_factor=int(hf.get("scale_factor", 2)),
        image_token_id=int(hf.get("image_token_id", 128257)),
        hidden_act=act,
        num_channels=int(vision.get("num_channels", 3)),
    )
    return replace(decoder, architecture=arch, vision=encoder)


# transformers' SiglipVisionConfig defaults as Gemma 3 uses them (vision_use_head false).
SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}


def _gemma3_vision_from_hf(hf: Mapping[str, Any], has_lm_head: bool) -> ModelConfig:
    """Gemma 3 with images: the Gemma 3 ``text_config`` under a SigLIP ``vision_config``, an
    average pool to ``mm_tokens_per_image`` tokens and a projection (models/gemma3_vision.py)."""
    text, vision = hf.get("text_config") or {}, hf.get("vision_config") or {}
    if not isinstance(text, Mapping) or not isinstance(vision, Mapping):
        raise ModelConfigError("config.json of gemma3 needs text_config and vision_config")
    if vision.get("vision_use_head"):
        raise ModelConfigError("gemma3 vision_config vision_use_head: true is not supported")
    tied = bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    text = {**text, "model_type": "gemma3_text", "tie_word_embeddings": tied}
    decoder = config_from_hf(text, has_lm_head=has_lm_head)
    vision = {**SIGLIP_DEFAULTS, **vision}
    act = _VISION_ACTIVATIONS.get(str(vision["hidden_act"]))
    if act is None:
        raise ModelConfigError(f"vision activation {vision['hidden_act']!r} is not supported")
    side = int(vision["image_size"]) // int(vision["patch_size"])
    tokens = int(hf.get("mm_tokens_per_image", 256))
    per_side = round(tokens**0.5)
    if per_side * per_side != tokens or side % per_side:
        raise ModelConfigError(
            f"mm_tokens_per_image {tokens} does not pool a {side}x{side} patch grid evenly"
        )
    encoder = VisionConfig(
        hidden_size=int(vision["hidden_size"]),
        intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]),
        num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]),
        patch_size=int(vision["patch_size"]),
        layer_norm_eps=float(vision["layer_norm_eps"]),
        scale_factor=side // per_side,
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 262_144))),
        hidden_act=act,
        num_channels=int(vision["num_channels"]),
        pooled=True,
    )
    if not 0 <= encoder.image_token_id < decoder.vocab_size:
        raise ModelConfigError(
            f"gemma3 image_token_index {encoder.image_token_id} lies outside the "
            f"{decoder.vocab_size}-token embedding"
        )
    return replace(decoder, vision=encoder)


# transformers' Qwen2Config defaults, for the keys a sparse text_config leaves out.
QWEN2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def _qwen2_audio_from_hf(hf: Mapping[str, Any], has_lm_head: bool) -> ModelConfig:
    """Qwen2-Audio: the Qwen2 ``text_config`` with the Whisper-style ``audio_config``."""
    text, audio = hf.get("text_config"), hf.get("audio_config")
    if not isinstance(text, Mapping) or not isinstance(audio, Mapping):
        raise ModelConfigError("config.json of qwen2_audio needs text_config and audio_config")
    if text.get("model_type", "qwen2") != "qwen2":
        raise ModelConfigError(f"qwen2_audio with a {text.get('model_type')!r} text model")
    tied = bool(text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False)))
    # The published config.json is sparse (Qwen2-Audio-7B's text_config names neither its
    # width nor its depth): transformers fills what is missing from Qwen2Config's defaults.
    text = {**QWEN2_DEFAULTS, **text, "model_type": "qwen2", "tie_word_embeddings": tied}
    decoder = config_from_hf(text, has_lm_head=has_lm_head)
    act = str(audio.get("activation_function", "gelu"))
    if act != "gelu":
        raise ModelConfigError(f"audio activation {act!r} is not supported (gelu)")
    if audio.get("scale_embedding"):
        raise ModelConfigError("audio_config scale_embedding: true is not supported")
    encoder = AudioConfig(
        num_mel_bins=int(audio.get("num_mel_bins", 128)),
        hidden_size=int(audio.get("d_model", 1280)),
        intermediate_size=int(audio.get("encoder_ffn_dim", 5120)),
        num_layers=int(audio.get("encoder_layers", 32)),
        num_heads=int(audio.get("encoder_attention_heads", 20)),
        max_source_positions=int(audio.get("max_source_positions", 1500)),
        audio_token_id=int(hf.get("audio_token_index", hf.get("audio_token_id", 151646))),
    )
    return replace(decoder, architecture="qwen2_audio", audio=encoder)


def _mrope_decoder(
    text: Mapping[str, Any],
    rope: Mapping[str, Any],
    section: list[Any],
    defaults: Mapping[str, Any],
    model_type: str,
    theta: float,
    tied: bool,
    has_lm_head: bool,
) -> ModelConfig:
    """A Qwen VL model's decoder: ``model_type``'s config from ``text`` with its rope settings
    minus the M-RoPE keys (the runner splits the rotary pairs by ``section``, which must cover
    the head exactly)."""
    mrope_keys = ("mrope_section", "mrope_interleaved", "type", "rope_type")
    plain_rope = {k: v for k, v in rope.items() if k not in mrope_keys}
    plain_rope.setdefault("rope_theta", text.get("rope_theta", theta))
    decoder = config_from_hf(
        {
            **defaults,
            **text,
            "model_type": model_type,
            "tie_word_embeddings": tied,
            "rope_parameters": plain_rope,
            "rope_scaling": None,
        },
        has_lm_head=has_lm_head,
    )
    if 2 * sum(int(s) for s in section) != decoder.head_dim:
        raise ModelConfigError(
            f"mrope_section {section} does not cover head_dim {decoder.head_dim}"
        )
    return decoder


def _qwen2_5_vl_from_hf(hf: Mapping[str, Any], has_lm_head: bool) -> ModelConfig:
    """Qwen2.5-VL: the published config.json is flat (the text keys at the top, ``rope_scaling``
    of type ``mrope``); transformers v5 saves them under ``text_config``. Either way a Qwen2
    decoder, whose rotary pairs M-RoPE splits by ``mrope_section``."""
    vision = hf.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ModelConfigError("config.json of qwen2_5_vl needs a vision_config")
    nested = hf.get("text_config")
    text = dict(nested) if isinstance(nested, Mapping) else dict(hf)
    tied = bool(text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False)))
    rope = _hf_rope(text)
    section = rope.get("mrope_section")
    if not isinstance(section, list) or not section:
        raise ModelConfigError("config.json of qwen2_5_vl lacks rope mrope_section")
    decoder = _mrope_decoder(
        text, rope, section, QWEN2_DEFAULTS, "qwen2", 1000000.0, tied, has_lm_head
    )
    if str(vision.get("hidden_act", "silu")) != "silu":
        raise ModelConfigError(f"vision activation {vision.get('hidden_act')!r} is not supported")
    vrope = vision.get("rope_parameters") or {}

    def token(name: str, default: int) -> int:
        return int(hf.get(name, text.get(name, default)))

    encoder = QwenVisionConfig(
        hidden_size=int(vision.get("hidden_size", 1280)),
        intermediate_size=int(vision.get("intermediate_size", 3420)),
        num_layers=int(vision.get("depth", 32)),
        num_heads=int(vision.get("num_heads", 16)),
        out_hidden_size=int(vision.get("out_hidden_size", decoder.hidden_size)),
        patch_size=int(vision.get("patch_size", 14)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        window_size=int(vision.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", ())),
        tokens_per_second=float(vision.get("tokens_per_second", 4)),
        image_token_id=token("image_token_id", 151655),
        video_token_id=token("video_token_id", 151656),
        vision_start_token_id=token("vision_start_token_id", 151652),
        rope_theta=float(vrope.get("rope_theta", 10000.0)) if isinstance(vrope, Mapping) else 1e4,
        in_channels=int(vision.get("in_chans", vision.get("in_channels", 3))),
    )
    if encoder.out_hidden_size != decoder.hidden_size:
        raise ModelConfigError("vision_config out_hidden_size differs from the text hidden_size")
    return replace(
        decoder,
        architecture="qwen2_5_vl",
        qwen_vision=encoder,
        mrope_section=tuple(int(s) for s in section),
    )


# transformers' Qwen3VLTextConfig defaults, for the keys a text_config leaves out.
QWEN3_VL_TEXT_DEFAULTS: dict[str, Any] = {
    **QWEN2_DEFAULTS,
    "head_dim": 128,
    "max_position_embeddings": 128000,
    "rope_theta": 500000.0,
}


# transformers' Qwen3VLMoeTextConfig defaults (head_dim: hidden_size over the heads).
QWEN3_VL_MOE_TEXT_DEFAULTS: dict[str, Any] = {
    **QWEN2_DEFAULTS,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 128000,
    "rope_theta": 500000.0,
}


def _qwen3_vl_from_hf(hf: Mapping[str, Any], has_lm_head: bool) -> ModelConfig:
    """Qwen3-VL: a Qwen3 ``text_config`` (q/k norms, no biases) whose rope settings carry
    ``mrope_section`` (interleaved), and a ``vision_config`` with LayerNorm blocks, a learned
    position grid and the deep-stack layers; Qwen3-VL-MoE's text config adds its experts."""
    model_type = str(hf.get("model_type"))
    vision, nested = hf.get("vision_config"), hf.get("text_config")
    if not isinstance(vision, Mapping) or not isinstance(nested, Mapping):
        raise ModelConfigError(f"config.json of {model_type} needs vision_config and text_config")
    tied = bool(hf.get("tie_word_embeddings", nested.get("tie_word_embeddings", False)))
    rope = _hf_rope(nested)
    section = rope.get("mrope_section")
    if not isinstance(section, list) or len(section) != 3:
        raise ModelConfigError(
            f"config.json of {model_type} lacks rope mrope_section (three values)"
        )
    moe = model_type == "qwen3_vl_moe"
    defaults = QWEN3_VL_MOE_TEXT_DEFAULTS if moe else QWEN3_VL_TEXT_DEFAULTS
    decoder = _mrope_decoder(nested, rope, section, defaults, "qwen3", 500000.0, tied, has_lm_head)
    if moe:
        decoder = replace(decoder, moe=_qwen3_vl_moe(nested, decoder.num_layers))
    if decoder.sliding_window is not None:  # transformers' Qwen3-VL attends over everything
        raise ModelConfigError("qwen3_vl with a sliding window is not supported")
    act = _VISION_ACTIVATIONS.get(str(vision.get("hidden_act", "gelu_pytorch_tanh")))
    if act != "gelu_tanh":
        raise ModelConfigError(f"vision activation {vision.get('hidden_act')!r} is not supported")
    vrope = vision.get("rope_parameters") or {}
    depth = int(vision.get("depth", 27))
    deepstack = tuple(int(i) for i in vision.get("deepstack_visual_indexes", (8, 16, 24)))
    if any(not 0 <= i < depth for i in deepstack) or len(deepstack) > decoder.num_layers:
        raise ModelConfigError(f"deepstack_visual_indexes {list(deepstack)} do not fit the model")
    positions = int(vision.get("num_position_embeddings", 2304))
    if int(positions**0.5) ** 2 != positions:
        raise ModelConfigError(f"num_position_embeddings {positions} is not a square grid")

    def token(name: str, default: int) -> int:
        return int(hf.get(name, default))

    encoder = QwenVisionConfig(
        hidden_size=int(vision.get("hidden_size", 1152)),
        intermediate_size=int(vision.get("intermediate_size", 4304)),
        num_layers=depth,
        num_heads=int(vision.get("num_heads", 16)),
        out_hidden_size=int(vision.get("out_hidden_size", decoder.hidden_size)),
        patch_size=int(vision.get("patch_size", 16)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        window_size=0,  # every block attends over a whole frame
        fullatt_block_indexes=tuple(range(depth)),
        tokens_per_second=0.0,  # a video's frames are laid out one by one, not by time
        image_token_id=token("image_token_id", 151655),
        video_token_id=token("video_token_id", 151656),
        vision_start_token_id=token("vision_start_token_id", 151652),
        rope_theta=float(vrope.get("rope_theta", 10000.0)) if isinstance(vrope, Mapping) else 1e4,
        in_channels=int(vision.get("in_channels", 3)),
        deepstack_indexes=deepstack,
        num_position_embeddings=positions,
        hidden_act=act,
    )
    if encoder.out_hidden_size != decoder.hidden_size:
        raise ModelConfigError("vision_config out_hidden_size differs from the text hidden_size")
    return replace(
        decoder,
        architecture="qwen3_vl",
        qwen_vision=encoder,
        mrope_section=tuple(int(s) for s in section),
        mrope_interleaved=True,
    )


# transformers' Gemma4TextConfig defaults, for the keys a config.json leaves out.
GEMMA4_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    },
}


def _qwen3_vl_moe(text: Mapping[str, Any], layers: int) -> MoeConfig | None:
    """Qwen3-VL-MoE's experts (None: there are none): every ``decoder_sparse_step``-th layer
    has them except the ``mlp_only_layers``, which keep a dense MLP. Its router renormalizes
    the top-k weights whatever ``norm_topk_prob`` says (transformers' Qwen3-VL-MoE reads no
    such key)."""
    # transformers' defaults; it saves ``num_experts`` as ``num_local_experts``
    experts = int(text.get("num_experts", text.get("num_local_experts", 60)) or 0)
    step = int(text.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in text.get("mlp_only_layers") or ()}
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if not experts or not sparse:
        return None
    return MoeConfig(
        num_experts=experts,
        top_k=int(text.get("num_experts_per_tok", 4)),
        intermediate_size=int(text.get("moe_intermediate_size", 1408)),
        layers=sparse,
    )


def _gemma4_from_hf(hf: Mapping[str, Any], has_lm_head: bool) -> ModelConfig:
    """Gemma 4's decoder (``gemma4_text``, or the ``text_config`` of ``gemma4``): Gemma 3's
    layers with the per-layer shapes, K/V sharing and per-layer embeddings of
    ``Gemma4Layers``, unscaled attention (q/k norms set the scale) and value norms."""
    text = hf.get("text_config") if hf.get("model_type") == "gemma4" else hf
    if not isinstance(text, Mapping):
        raise ModelConfigError("config.json of gemma4 needs a text_config")
    tied = bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    text = {**GEMMA4_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if text.get("use_bidirectional_attention") == "all":
        raise ModelConfigError("gemma4 use_bidirectional_attention: all is not supported")
    if text.get("attention_bias"):
        raise ModelConfigError("config.json attention_bias: true is not supported for gemma4")
    act = _HF_ACTIVATIONS.get(str(text["hidden_activation"]))
    if act != "gelu_tanh":
        raise ModelConfigError(f"gemma4 activation {text['hidden_activation']!r} is not supported")
    layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
    head_dim, kv_heads = int(text["head_dim"]), int(text["num_key_value_heads"])
    types = text.get("layer_types") or [
        "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
        for i in range(layers)
    ]
    if len(types) != layers:
        raise ModelConfigError(f"config.json layer_types has {len(types)} entries")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    k_eq_v = bool(text.get("attention_k_eq_v", False))
    # transformers writes the global layers' shape per layer (``per_layer_config``); a
    # config written before that names it once.
    overrides = text.get("per_layer_config") or {}
    shapes = {
        (int(o.get("num_key_value_heads", kv_heads)), int(o.get("head_dim", head_dim)))
        for i, o in overrides.items()
        if types[int(i)] == "full_attention"
    }
    if len(shapes) > 1:
        raise ModelConfigError(f"gemma4 global layers of different shapes: {sorted(shapes)}")
    global_kv, global_dim = (
        shapes.pop()
        if shapes
        else (
            int(text.get("num_global_key_value_heads") or kv_heads) if k_eq_v else kv_heads,
            int(text["global_head_dim"]),
        )
    )
    rope = text["rope_parameters"]
    full = dict(rope.get("full_attention") or {})
    local = dict(rope.get("sliding_attention") or {})
    if (
        full.get("rope_type", "default") not in ("default", "proportional")
        or float(full.get("factor", 1.0)) != 1.0
    ):
        raise ModelConfigError(f"gemma4 global RoPE {full} is not supported")
    if local.get("rope_type", "default") != "default":
        raise ModelConfigError(f"gemma4 sliding RoPE {local} is not supported")
    fraction = float(full.get("partial_rotary_factor", 1.0))
    if full.get("rope_type", "default") == "default":
        fraction = 1.0  # plain RoPE rotates every channel whatever the factor says
    per_layer = int(text.get("hidden_size_per_layer_input") or 0)
    layers_cfg = Gemma4Layers(
        global_head_dim=global_dim,
        global_kv_heads=global_kv,
        k_eq_v=k_eq_v,
        kv_shared_layers=int(text.get("num_kv_shared_layers") or 0),
        per_layer_size=per_layer,
        per_layer_vocab=int(text["vocab_size_per_layer_input"]) if per_layer else 0,
        double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
        global_rotary_fraction=fraction,
        pad_token_id=int(text.get("pad_token_id") or 0),
    )
    cfg = gemma4_decoder_config(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(text["rms_norm_eps"]),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_local_theta=float(local.get("rope_theta", GEMMA3_LOCAL_ROPE_BASE)),
        max_position=int(text["max_position_embeddings"]),
        tie_word_embeddings=tied or not has_lm_head,
        sliding_window=int(text["sliding_window"]) if sliding else None,
        sliding_layers=sliding,
        final_softcap=_float_or_none(text.get("final_logit_softcapping")),
        layers=layers_cfg,
    )
    if text.get("enable_moe_block"):
        cfg = replace(cfg, moe=_gemma4_moe(text, layers))
    vision = hf.get("vision_config") if hf.get("model_type") == "gemma4" else None
    if isinstance(vision, Mapping):
        bidirectional = text.get("use_bidirectional_attention") == "vision"
        cfg = replace(cfg, gemma4_vision=_gemma4_vision_from_hf(hf, vision, bidirectional))
    audio = hf.get("audio_config") if hf.get("model_type") == "gemma4" else None
    if isinstance(audio, Mapping):
        cfg = replace(cfg, gemma4_audio=_gemma4_audio_from_hf(hf, audio))
    return cfg


def _gemma4_moe(text: Mapping[str, Any], layers: int) -> MoeConfig:
    """Gemma 4's experts (``enable_moe_block``): in every layer, beside the dense MLP."""
    keys = ("num_experts", "top_k_experts", "moe_intermediate_size")
    missing = [k for k in keys if not text.get(k)]
    if missing:
        raise ModelConfigError(f"gemma4 enable_moe_block without {', '.join(missing)}")
    return MoeConfig(
        num_experts=int(text["num_experts"]),
        top_k=int(text["top_k_experts"]),
        intermediate_size=int(text["moe_intermediate_size"]),
        layers=tuple(range(layers)),
    )


def gemma4_decoder_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rms_norm_eps: float,
    rope_theta: float,
    rope_local_theta: float,
    max_position: int,
    tie_word_embeddings: bool,
    sliding_window: int | None,
    sliding_layers: tuple[int, ...],
    final_softcap: float | None,
    layers: Gemma4Layers,
) -> ModelConfig:
    """Gemma 4's decoder from its shape, however the checkpoint spells it (a config.json, a
    GGUF's metadata): unscaled GeGLU attention with q/k norms; every K/V-sharing layer must
    have a source (ModelConfigError otherwise). Gemma 3n's decoder is this one plus its own
    parts."""
    cfg = ModelConfig(
        architecture="gemma4",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=RopeScaling(),
        max_position=max_position,
        tie_word_embeddings=tie_word_embeddings,
        qk_norm=True,
        sliding_window=sliding_window,
        sliding_layers=sliding_layers,
        final_softcap=final_softcap,
        attention_scale=1.0,  # the q/k norms stand in for the usual 1/sqrt(head size)
        hidden_act="gelu_tanh",
        rope_local_theta=rope_local_theta,
        gemma4=layers,
    )
    for layer in range(num_layers - layers.kv_shared_layers, num_layers):
        cfg.kv_source(layer)  # every sharing layer has a source (raises otherwise)
    return cfg


# transformers' Gemma3nTextConfig defaults (E4B's shape).
GEMMA3N_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_400,
    "hidden_size": 2048,
    "intermediate_size": 16_384,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "final_logit_softcapping": 30.0,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "altup_active_idx": 0,
    "altup_correct_scale": True,
    "altup_num_inputs": 4,
    "num_kv_shared_layers": 15,
    "laurel_rank": 64,
    "pad_token_id": 0,
}


def gemma3n_text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's settings of a ``gemma3n`` or ``gemma3n_text`` config.json, with
    transformers' defaults filled in and its per-layer lists written out (one entry a layer):
    ``layer_types``, ``intermediate_size`` and ``activation_sparsity_pattern``."""
    text = hf.get("text_config") if hf.get("model_type") == "gemma3n" else hf
    if not isinstance(text, Mapping):
        raise ModelConfigError("config.json of gemma3n needs a text_config")
    text = {**GEMMA3N_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    layers = int(text["num_hidden_layers"])
    if not text.get("layer_types"):  # four sliding layers, then a global one
        text["layer_types"] = [
            "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)
        ]
    sizes = text["intermediate_size"]
    text["intermediate_size"] = list(sizes) if isinstance(sizes, list) else [sizes] * layers
    sparsity = text.get("activation_sparsity_pattern")
    if sparsity is None:  # the first ten layers of a model of more than ten
        sparse = 10 if layers > 10 else 0
        sparsity = [0.95] * sparse + [0.0] * (layers - sparse)
    elif not isinstance(sparsity, list):
        sparsity = [sparsity] * layers
    text["activation_sparsity_pattern"] = list(sparsity)
    for key in ("layer_types", "intermediate_size", "activation_sparsity_pattern"):
        if len(text[key]) != layers:
            raise ModelConfigError(
                f"config.json {key} has {len(text[key])} entries for {layers} layers"
            )
    return text


# transformers' Gemma3nVisionConfig and Gemma3nAudioConfig: their vocabulary ranges and widths.
GEMMA3N_MEDIA_VOCAB_DEFAULTS = {
    "vision_config": ("embed_vision", 262_144, 128, 2048),
    "audio_config": ("embed_audio", 262_272, 128, 1536),
}


def _gemma3n_media_vocab(hf: Mapping[str, Any]) -> tuple[Gemma3nMediaVocab, ...]:
    """The ids Gemma3nForConditionalGeneration embeds with its encoders' tables (none for a
    bare Gemma3nForCausalLM, which embeds every id with its text table)."""
    if hf.get("model_type") != "gemma3n":
        return ()
    found = []
    for key, (name, offset, size, width) in GEMMA3N_MEDIA_VOCAB_DEFAULTS.items():
        sub = hf.get(key)
        if isinstance(sub, Mapping):
            found.append(
                Gemma3nMediaVocab(
                    name=name,
                    offset=int(sub.get("vocab_offset", offset)),
                    size=int(sub.get("vocab_size", size)),
                    hidden_size=int(sub.get("hidden_size", width)),
                    rms_norm_eps=float(sub.get("rms_norm_eps", 1e-6)),
                )
            )
    return tuple(found)


def _gemma3n_from_hf(hf: Mapping[str, Any], has_lm_head: bool) -> ModelConfig:
    """Gemma 3n's decoder (``gemma3n_text``, or the ``text_config`` of ``gemma3n``, whose audio
    encoder is ``gemma3n_audio`` and image encoder ``gemma3n_vision``, timm's MobileNet-v5):
    Gemma 4's layer parts (PLE, K/V sharing, q/k/v norms, unscaled attention; one head shape
    for all layers) plus ``Gemma3nLayers``."""
    tied = bool(hf.get("tie_word_embeddings", True))
    text = gemma3n_text_config(hf)
    vision = _gemma3n_vision_from_hf(hf)
    if text.get("attention_bias"):
        raise ModelConfigError("config.json attention_bias: true is not supported for gemma3n")
    if _HF_ACTIVATIONS.get(str(text["hidden_activation"])) != "gelu_tanh":
        raise ModelConfigError(f"gemma3n activation {text['hidden_activation']!r} is not supported")
    layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
    head_dim, kv_heads = int(text["head_dim"]), int(text["num_key_value_heads"])
    types = text["layer_types"]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    rope = _hf_rope(text)
    full = dict(rope.get("full_attention") or {})
    local = dict(rope.get("sliding_attention") or {})
    for kind, params in (("global", full), ("sliding", local)):
        if params.get("rope_type", "default") != "default":
            raise ModelConfigError(f"gemma3n {kind} RoPE {params} is not supported")
    own = Gemma3nLayers(
        altup_inputs=int(text["altup_num_inputs"]),
        altup_active=int(text["altup_active_idx"]),
        altup_correct_scale=bool(text["altup_correct_scale"]),
        laurel_rank=int(text["laurel_rank"]),
        intermediate_sizes=tuple(int(n) for n in text["intermediate_size"]),
        sparsity=tuple(float(s) for s in text["activation_sparsity_pattern"]),
        source_layers=tuple(range(layers)),
        source_num_layers=layers,
        # an image encoder other than MobileNet-v5 is not served; images are refused
        unserved_media=("image",) if vision is None and _has_vision_config(hf) else (),
        media_vocab=_gemma3n_media_vocab(hf),
    )
    decoder = gemma3n_decoder_config(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(text["rms_norm_eps"]),
        rope_theta=float(full.get("rope_theta", text.get("rope_theta", 1_000_000.0))),
        rope_local_theta=float(
            local.get("rope_theta", text.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_BASE))
        ),
        max_position=int(text["max_position_embeddings"]),
        tie_word_embeddings=tied or not has_lm_head,
        sliding_window=int(text["sliding_window"]),
        sliding_layers=sliding,
        final_softcap=_float_or_none(text.get("final_logit_softcapping")),
        kv_shared_layers=int(text["num_kv_shared_layers"] or 0),
        per_layer_size=int(text["hidden_size_per_layer_input"]),
        per_layer_vocab=int(text["vocab_size_per_layer_input"]),
        layers=own,
    )
    return replace(decoder, gemma3n_audio=_gemma3n_audio_from_hf(hf), gemma3n_vision=vision)


def gemma3n_decoder_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rms_norm_eps: float,
    rope_theta: float,
    rope_local_theta: float,
    max_position: int,
    tie_word_embeddings: bool,
    sliding_window: int,
    sliding_layers: tuple[int, ...],
    final_softcap: float | None,
    kv_shared_layers: int,
    per_layer_size: int,
    per_layer_vocab: int,
    layers: Gemma3nLayers,
) -> ModelConfig:
    """Gemma 3n's decoder from its shape, however the checkpoint spells it (a config.json, a
    GGUF's metadata): Gemma 4's layer parts (PLE, K/V sharing, q/k/v norms, unscaled attention;
    one head shape for all layers) plus ``layers``; ModelConfigError for what it cannot run."""
    if not per_layer_size:
        raise ModelConfigError("gemma3n without per-layer inputs is not supported")
    if not 0 <= layers.altup_active < layers.altup_inputs:
        raise ModelConfigError(f"gemma3n altup_active_idx {layers.altup_active} out of range")
    if any(not 0.0 <= s < 1.0 for s in layers.sparsity):
        raise ModelConfigError("gemma3n activation_sparsity_pattern values must lie in [0, 1)")
    shared = Gemma4Layers(
        global_head_dim=head_dim,
        global_kv_heads=num_kv_heads,
        k_eq_v=False,
        kv_shared_layers=kv_shared_layers,
        per_layer_size=per_layer_size,
        per_layer_vocab=per_layer_vocab,
        double_wide_mlp=False,
        global_rotary_fraction=1.0,
        pad_token_id=0,  # ids past the PLE table read its row 0
    )
    decoder = gemma4_decoder_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=max(layers.intermediate_sizes),
        num_layers=len(layers.intermediate_sizes),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        rope_local_theta=rope_local_theta,
        max_position=max_position,
        tie_word_embeddings=tie_word_embeddings,
        sliding_window=sliding_window if sliding_layers else None,
        sliding_layers=sliding_layers,
        final_softcap=final_softcap,
        layers=shared,
    )
    return replace(decoder, architecture="gemma3n", gemma3n=layers)


GEMMA3N_VISION_ARCHITECTURE = "mobilenetv5_300m_enc"  # Gemma3nVisionConfig's default
# transformers' Gemma3nVisionConfig and Gemma3nConfig defaults.
GEMMA3N_VISION_TOKENS = {"vision_soft_tokens_per_image": 256, "image_token_id": 262_145}
MOBILENET_V5_ARGS = {"channel_multiplier": 1.0, "msfa_output_resolution": 16}


def _has_vision_config(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") == "gemma3n" and isinstance(hf.get("vision_config"), Mapping)


def _gemma3n_vision_from_hf(hf: Mapping[str, Any]) -> Gemma3nVisionConfig | None:
    """The image encoder of a Gemma3nForConditionalGeneration config: None without one or
    when it is not timm's MobileNet-v5 encoder; ``model_args`` other than the channel
    multiplier and the fused resolution change the network: refused."""
    if not _has_vision_config(hf):
        return None
    vision = hf["vision_config"]
    if vision.get("architecture", GEMMA3N_VISION_ARCHITECTURE) != GEMMA3N_VISION_ARCHITECTURE:
        return None
    args = {**MOBILENET_V5_ARGS, **(vision.get("model_args") or {})}
    unknown = sorted(set(args) - set(MOBILENET_V5_ARGS))
    if unknown:
        raise ModelConfigError(f"gemma3n vision_config model_args {unknown} are not supported")
    top = {**GEMMA3N_VISION_TOKENS, **{k: hf[k] for k in GEMMA3N_VISION_TOKENS if hf.get(k)}}
    return Gemma3nVisionConfig(
        channel_multiplier=float(args["channel_multiplier"]),
        output_resolution=int(args["msfa_output_resolution"]),
        hidden_size=int(vision.get("hidden_size", 2048)),
        soft_tokens=int(top["vision_soft_tokens_per_image"]),
        image_token_id=int(top["image_token_id"]),
    )


# transformers' Gemma3nAudioConfig defaults, and Gemma3nConfig's audio settings.
GEMMA3N_AUDIO_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1536,
    "input_feat_size": 128,
    "rms_norm_eps": 1e-6,
    "gradient_clipping": 1e10,
    "conf_attention_chunk_size": 12,
    "conf_attention_context_left": 13,
    "conf_attention_context_right": 0,
    "conf_attention_logit_cap": 50.0,
    "conf_num_attention_heads": 8,
    "conf_num_hidden_layers": 12,
    "conf_conv_kernel_size": 5,
    "conf_reduction_factor": 4,
    "conf_residual_weight": 0.5,
    "sscp_conv_channel_size": [128, 32],
    "sscp_conv_group_norm_eps": 1e-3,
    "sscp_conv_kernel_size": [[3, 3], [3, 3]],
    "sscp_conv_stride_size": [[2, 2], [2, 2]],
}
GEMMA3N_AUDIO_TOKENS = {"audio_soft_tokens_per_image": 188, "audio_token_id": 262_273}


def _pairs(value: Any, what: str) -> tuple[tuple[int, int], tuple[int, int]]:
    pairs = [tuple(int(v) for v in pair) for pair in value]
    if len(pairs) != 2 or any(len(pair) != 2 for pair in pairs):
        raise ModelConfigError(f"gemma3n audio needs two (time, frequency) {what}, not {value}")
    return (pairs[0][0], pairs[0][1]), (pairs[1][0], pairs[1][1])


def _gemma3n_audio_from_hf(hf: Mapping[str, Any]) -> Gemma3nAudioConfig | None:
    """The audio encoder of a Gemma3nForConditionalGeneration config (None without one)."""
    audio = hf.get("audio_config")
    if hf.get("model_type") != "gemma3n" or not isinstance(audio, Mapping):
        return None
    a = {**GEMMA3N_AUDIO_DEFAULTS, **{k: x for k, x in audio.items() if x is not None}}
    top = {**GEMMA3N_AUDIO_TOKENS, **{k: hf[k] for k in GEMMA3N_AUDIO_TOKENS if hf.get(k)}}
    channels = [int(c) for c in a["sscp_conv_channel_size"]]
    if len(channels) != 2:
        raise ModelConfigError(f"gemma3n audio needs two conv channel counts, not {channels}")
    return Gemma3nAudioConfig(
        hidden_size=int(a["hidden_size"]),
        num_layers=int(a["conf_num_hidden_layers"]),
        num_heads=int(a["conf_num_attention_heads"]),
        mel_bins=int(a["input_feat_size"]),
        conv_channels=(channels[0], channels[1]),
        conv_kernels=_pairs(a["sscp_conv_kernel_size"], "conv kernel sizes"),
        conv_strides=_pairs(a["sscp_conv_stride_size"], "conv strides"),
        group_norm_eps=float(a["sscp_conv_group_norm_eps"]),
        lconv_kernel_size=int(a["conf_conv_kernel_size"]),
        residual_weight=float(a["conf_residual_weight"]),
        chunk_size=int(a["conf_attention_chunk_size"]),
        context_left=int(a["conf_attention_context_left"]),
        context_right=int(a["conf_attention_context_right"]),
        logit_cap=float(a["conf_attention_logit_cap"]),
        reduction=int(a["conf_reduction_factor"]),
        gradient_clipping=float(a["gradient_clipping"]),
        rms_norm_eps=float(a["rms_norm_eps"]),
        soft_tokens=int(top["audio_soft_tokens_per_image"]),
        audio_token_id=int(top["audio_token_id"]),
    )


# transformers' Gemma4AudioConfig defaults.
GEMMA4_AUDIO_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "hidden_act": "silu",
    "subsampling_conv_channels": [128, 32],
    "conv_kernel_size": 5,
    "residual_weight": 0.5,
    "attention_chunk_size": 12,
    "attention_context_left": 13,
    "attention_context_right": 0,
    "attention_logit_cap": 50.0,
    "attention_invalid_logits_value": -1.0e9,
    "use_clipped_linears": True,
    "rms_norm_eps": 1e-6,
    "gradient_clipping": 1e10,
    "output_proj_dims": 1536,
}


def _gemma4_audio_from_hf(hf: Mapping[str, Any], audio: Mapping[str, Any]) -> Gemma4AudioConfig:
    a = {**GEMMA4_AUDIO_DEFAULTS, **{k: x for k, x in audio.items() if x is not None}}
    if a["hidden_act"] not in ("silu", "swish"):
        raise ModelConfigError(f"gemma4 audio activation {a['hidden_act']!r} is not supported")
    channels = [int(c) for c in a["subsampling_conv_channels"]]
    if len(channels) != 2:
        raise ModelConfigError(f"gemma4 audio needs two conv channel counts, not {channels}")
    return Gemma4AudioConfig(
        hidden_size=int(a["hidden_size"]),
        num_layers=int(a["num_hidden_layers"]),
        num_heads=int(a["num_attention_heads"]),
        conv_channels=(channels[0], channels[1]),
        conv_kernel_size=int(a["conv_kernel_size"]),
        residual_weight=float(a["residual_weight"]),
        chunk_size=int(a["attention_chunk_size"]),
        context_left=int(a["attention_context_left"]),
        context_right=int(a["attention_context_right"]),
        logit_cap=float(a["attention_logit_cap"]),
        invalid_logit=float(a["attention_invalid_logits_value"]),
        clipped_linears=bool(a["use_clipped_linears"]),
        rms_norm_eps=float(a["rms_norm_eps"]),
        gradient_clipping=float(a["gradient_clipping"]),
        output_dims=int(a["output_proj_dims"]),
        audio_token_id=int(hf.get("audio_token_id") or 258_881),
    )


# transformers' Gemma4VisionConfig defaults.
GEMMA4_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "pooling_kernel_size": 3,
    "patch_size": 16,
    "position_embedding_size": 10 * 1024,
    "use_clipped_linears": False,
    "standardize": False,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}


def _gemma4_vision_from_hf(
    hf: Mapping[str, Any], vision: Mapping[str, Any], bidirectional: bool
) -> Gemma4VisionConfig:
    v = {**GEMMA4_VISION_DEFAULTS, **{k: x for k, x in vision.items() if x is not None}}
    if _HF_ACTIVATIONS.get(str(v["hidden_activation"])) != "gelu_tanh":
        raise ModelConfigError(
            f"gemma4 vision activation {v['hidden_activation']!r} is not supported"
        )
    if v.get("attention_bias"):
        raise ModelConfigError("gemma4 vision attention_bias: true is not supported")
    rope = v["rope_parameters"] or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelConfigError(f"gemma4 vision RoPE {rope.get('rope_type')!r} is not supported")
    return Gemma4VisionConfig(
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_layers=int(v["num_hidden_layers"]),
        num_heads=int(v["num_attention_heads"]),
        num_kv_heads=int(v["num_key_value_heads"]),
        head_dim=int(v["head_dim"]),
        patch_size=int(v["patch_size"]),
        pooling=int(v["pooling_kernel_size"]),
        position_table_size=int(v["position_embedding_size"]),
        rms_norm_eps=float(v["rms_norm_eps"]),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        standardize=bool(v["standardize"]),
        clipped_linears=bool(v["use_clipped_linears"]),
        image_token_id=int(hf.get("image_token_id") or 258_880),
        video_token_id=int(hf.get("video_token_id") or 258_884),
        bidirectional=bidirectional,
    )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _hf_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE settings: transformers v5 ``rope_parameters``, else v4 ``rope_scaling``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ModelConfigError("config.json rope_parameters must be an object")
    return dict(params)


def _hf_rope_scaling(rope: Mapping[str, Any]) -> RopeScaling:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return RopeScaling()
    factor = float(rope.get("factor", 1.0))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=factor,
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        )
    raise ModelConfigError(f"rope scaling type {kind!r} is not supported")


def _hf_sliding(
    hf: Mapping[str, Any], arch: str, num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers that use it, as transformers decides them."""
    window = hf.get("sliding_window")
    if arch == "qwen2" or arch == "qwen3":
        window = window if hf.get("use_sliding_window") else None
    if window is None:
        return None, ()
    types = hf.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ModelConfigError(f"config.json layer_types has {len(types)} entries")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif arch == "gemma2":
        layers = tuple(range(0, num_layers, 2))
    elif arch in ("qwen2", "qwen3"):
        layers = tuple(range(int(hf.get("max_window_layers", num_layers)), num_layers))
    elif arch == "gemma3":  # v4: five sliding layers, then a global one
        period = int(hf.get("sliding_window_pattern", GEMMA3_SLIDING_PATTERN))
        layers = tuple(i for i in range(num_layers) if (i + 1) % period != 0)
    else:  # Mistral, Phi-3: every layer
        layers = tuple(range(num_layers))
    return (int(window), layers) if layers else (None, ())
