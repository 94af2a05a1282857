"""Media decoding: bytes of an image, audio clip or video into what a model's processor reads.

A layer of its own that imports only the base layer; the server (which checks and loads a
request's media) and the models (whose processors read the decoded media) sit above it.

- ``sniff``   the real container format from magic bytes (declared types are not trusted)
- ``limits``  ``MediaLimits``: pixels, seconds, frames and sample rate, checked from the headers
              before any heavy decoding, and ``MediaError``, the one exception a caller catches
- ``types``   ``DecodedImage``, ``DecodedAudio``, ``DecodedVideo``
- ``image``   Pillow; the same steps as transformers' ``load_image`` (EXIF orientation, RGB)
- ``audio``   soundfile (WAV, FLAC, Ogg, MP3) or PyAV (MP4/M4A, WebM); resampling by PyAV
- ``video``   PyAV; frames sampled evenly by index, as transformers' video processors do
- ``decode``  ``decode_media``: one entry point by modality

This ``__init__`` imports nothing heavy: Pillow and PyAV load with ``image``/``audio``/``video``.
"""
