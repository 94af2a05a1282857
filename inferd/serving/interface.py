"""The server's view of the engine: every engine and loading type (and the few helpers) that
``inferd.server`` names, re-exported here so the server imports ``serving`` alone and the layers
below it stay free to move. Names and objects are the originals; nothing is wrapped."""

from __future__ import annotations

from inferd.engine.async_engine import AdmissionError, EngineBusyError, EngineStoppedError
from inferd.engine.embedding import EmbeddingInputError, EmbeddingModel
from inferd.engine.lora_slots import ADAPTER_CHANGED, ADAPTER_UNAVAILABLE
from inferd.engine.outputs import RequestOutput, TokenLogprob
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParamError, SamplingParams
from inferd.engine.thinking import ThinkingSpec
from inferd.loading.calibration import DEFAULT_CHUNK_SIZE
from inferd.loading.chat_template import ChatTemplateError, NoChatTemplateError, RenderedChat
from inferd.loading.imatrix import ImatrixError
from inferd.loading.lora import LoraError, check_name
from inferd.loading.quantize import QuantizeError, isq_method

__all__ = [
    "ADAPTER_CHANGED",
    "ADAPTER_UNAVAILABLE",
    "DEFAULT_CHUNK_SIZE",
    "AdmissionError",
    "ChatTemplateError",
    "EmbeddingInputError",
    "EmbeddingModel",
    "EngineBusyError",
    "EngineStoppedError",
    "ImatrixError",
    "LoraError",
    "MediaInput",
    "NoChatTemplateError",
    "QuantizeError",
    "RenderedChat",
    "RequestOutput",
    "SamplingParamError",
    "SamplingParams",
    "ThinkingSpec",
    "TokenLogprob",
    "check_name",
    "isq_method",
]
