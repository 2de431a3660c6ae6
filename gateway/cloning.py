"""A request's cloned voice: its reference clip encoded, or its saved voice, as the prompt's voice.

`clone_voice` runs in a speech handler after validation and before admission, so a request waiting
for its clip's encoding holds no stream: it decodes the clip (a multipart `audio` file on
/generate, `ref_audio` on /v1/audio/speech; gateway.clips), has it encoded (gateway.references:
cached by content, shared between requests) and puts the features in `GenerateParams.clone`, which
travels to the tokenizer worker in each segment's `GenerateRequest.voice`. A `voice` that names a
saved voice (gateway.voices) takes its stored features instead, and the model's default voice
fills `voice` for the prompt builder (a saved voice is no voice of the model's).
"""

from __future__ import annotations

import dataclasses

from common.messages import ModelSpec, VoiceFeatures
from gateway.body import Upload
from gateway.clips import Clip, ClipLimits, clip_bytes, read_clip
from gateway.events import Failed
from gateway.fields import BadRequest
from gateway.pipeline import Pipeline
from gateway.validation import GenerateParams


def clip_limits(pipeline: Pipeline) -> ClipLimits:
    g = pipeline.cfg.gateway
    return ClipLimits(g.max_reference_bytes, g.max_reference_seconds)


def refuse_clip(spec: ModelSpec, field: str) -> BadRequest:
    voices = ", ".join(spec.voices)
    return BadRequest(
        f"field {field!r}: model {spec.name} does not clone voices; leave the reference clip out"
        + (f" and choose one of its voices: {voices}" if voices else ""),
        param=field,
        code="unsupported_value",
    )


async def decode_upload(pipeline: Pipeline, spec: ModelSpec, upload: Upload | str, field: str) -> Clip:
    """A clip (a multipart file, or a field's base64 / data URL) decoded at the model's rate."""
    if spec.reference_sample_rate <= 0:
        raise refuse_clip(spec, field)
    limits = clip_limits(pipeline)
    data = upload.data if isinstance(upload, Upload) else clip_bytes(upload, limits, field)
    return await read_clip(data, spec.reference_sample_rate, limits, field)


async def clone_voice(
    pipeline: Pipeline, spec: ModelSpec, params: GenerateParams, upload: Upload | None = None
) -> GenerateParams | Failed:
    """`params` with its cloned voice filled in (unchanged without a clip or a saved voice), or a
    Failed when the encoding failed. Raises BadRequest for what the client must change."""
    saved = pipeline.voices.get(params.voice, spec.name) if params.voice else None
    given: Upload | str | None = upload if upload is not None else (params.ref_audio or None)
    field = "audio" if upload is not None else "ref_audio"
    if given is None and saved is None:
        if params.ref_text:
            raise BadRequest(
                "field 'ref_text' is what a reference clip says: send the clip with it, or leave it out",
                param="ref_text",
            )
        return params
    if saved is not None:
        if given is not None or params.ref_text:
            raise BadRequest(
                f"voice {params.voice!r} is a saved voice, which has its clip and text already: leave "
                f"{field!r} and 'ref_text' out, or choose a voice of the model",
                param="voice",
            )
        clone = VoiceFeatures(saved.features, saved.text)
        return dataclasses.replace(params, voice=spec.default_voice, clone=clone)
    clip = await decode_upload(pipeline, spec, given, field)
    features = await pipeline.references.encode(clip, params.ref_text)
    if isinstance(features, Failed):
        return features
    return dataclasses.replace(params, clone=VoiceFeatures(features, params.ref_text))
