"""From a model source to a loaded model: file formats (GGUF, safetensors), tokenizers, chat
templates, weight plans and in-situ quantization. ``loading.model.load`` is the one entry; it
returns a ``LoadedModel`` that ``serving.served.assemble`` puts an engine around. Loading sits
beside ``models``: it may import models, layers and kernels, and nothing above them."""
