"""The speech request fields of vLLM-Omni's and SGLang-Omni's APIs, so their clients work unchanged.

Those servers extend OpenAI's `POST /v1/audio/speech` with `stream`, `language`, `task_type`,
`non_streaming_mode` and voice cloning (`ref_audio`, `ref_text`). Here they mean:

- `stream`: true = the audio in chunks as it is decoded, false = one complete file (voxpipe's own
  `streaming`; a request giving both must give the same value).
- `language`: one of the model's languages (`ModelSpec.languages`) or "auto", in any letter case;
  a named language reaches the program as the model option `language`, "auto" as no option. A
  model without a list of languages takes only "auto".
- `task_type`: "CustomVoice" for a model with preset voices, "VoiceDesign" for one without (its
  voice is described in `instructions`), and "Base" (voice cloning) for a model that clones (the
  only one of a cloning model without preset voices).
- `ref_audio`, `ref_text`: voice cloning, a reference clip (base64 of an audio file, or a data URL
  holding it; gateway.clips) and what it says. A model that does not clone (`ModelSpec.
  reference_sample_rate` 0) refuses them with a 400 that names the model.
- `non_streaming_mode` (the omni servers' prompt mode): true, the prompt holds the whole text before the
  first audio token; false, for a model that lists it among its options, the text enters as the
  audio goes. It reaches the program as the model option of that name.
- The model's own options (string fields, `ModelSpec.options`) that take "true" or "false" come
  from those clients as JSON booleans: a boolean there is read as "true" or "false" (the program
  checks the value, as it checks any option's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.messages import ModelSpec
from gateway.fields import BadRequest, Field, per_spec, show

TASK_TYPES = ("CustomVoice", "VoiceDesign", "Base")  # the task types vLLM-Omni and SGLang-Omni know
CLONING_FIELDS = ("ref_audio", "ref_text")


@per_spec
def omni_fields(spec: ModelSpec) -> list[Field]:
    """The fields, as `gateway.validation.speech_fields` lists them after OpenAI's."""
    languages = ("auto", *spec.languages)
    clones = spec.reference_sample_rate > 0
    # A cloning model without preset voices serves "Base" alone.
    task = "CustomVoice" if spec.voices else ("Base" if clones else "VoiceDesign")
    tasks = (task, "Base") if clones and task != "Base" else (task,)
    both_modes = "non_streaming_mode" in spec.options
    return [
        Field(
            "stream",
            "boolean",
            "vLLM-Omni/SGLang-Omni's name for streaming: true = the audio in chunks as it is decoded, "
            "false = one complete file. Default: streaming's.",
        ),
        Field(
            "language",
            "string",
            "The language of the input: auto, or one of the model's languages (any letter case).",
            "auto",
            choices=languages,
            choice_error=f"model {spec.name} does not speak {{value}}; its languages: {{choices}}",
        ),
        Field(
            "task_type",
            "string",
            f"{task}: "
            + ("a task" if len(tasks) > 1 else "the only task")
            + f" model {spec.name} serves"
            + {
                "CustomVoice": " (one of its voices)",
                "VoiceDesign": " (the voice described in instructions)",
                "Base": " (voice cloning: ref_audio or a saved voice)",
            }[task]
            + ("; Base: voice cloning (ref_audio)." if len(tasks) > 1 else "."),
            task,
            choices=tasks,
            choice_error=f"task_type {{value}} is not served by model {spec.name}: its task is {task}"
            + ("" if clones else "; voice cloning (Base) is not available"),
        ),
        Field(
            "non_streaming_mode",
            "boolean",
            "The prompt mode: true, the prompt holds the whole text before the first audio "
            "token" + ("; false, the text enters as the audio goes." if both_modes else " (the only mode)."),
            True,
            choices=(True, False) if both_modes else (True,),
            choice_error=f"non_streaming_mode {{value}} is not available for model {spec.name}: its "
            "prompt holds the whole text before the first audio token (non_streaming_mode true)",
        ),
        *(_cloning_fields(spec) if clones else _no_cloning_fields(spec)),
    ]


def _cloning_fields(spec: ModelSpec) -> list[Field]:
    return [
        Field(
            "ref_audio",
            "string",
            "Voice cloning: a reference clip, base64 of an audio file (wav, flac, ogg, mp3) or a data "
            "URL holding it (data:audio/wav;base64,...); the voice speaks as the clip does.",
        ),
        ref_text_field(spec),
    ]


def _no_cloning_fields(spec: ModelSpec) -> list[Field]:
    return [
        Field(
            name,
            "string",
            f"Voice cloning; model {spec.name} does not clone voices, so it must be empty.",
            max_length=0,
            max_length_hint="voice cloning is not served: leave the field out",
        )
        for name in CLONING_FIELDS
    ]


REF_TEXT_MAX_CHARS = 4000


def ref_text_field(spec: ModelSpec) -> Field:
    """`ref_text`, what a reference clip says (the model's cloning takes it; empty when unknown)."""
    if spec.reference_sample_rate > 0:
        return Field(
            "ref_text",
            "string",
            "Voice cloning: what the reference clip says (empty: unknown).",
            max_length=REF_TEXT_MAX_CHARS,
            max_length_hint="send a shorter clip and its text",
        )
    return Field(
        "ref_text",
        "string",
        f"Voice cloning; model {spec.name} does not clone voices, so it must be empty.",
        max_length=0,
        max_length_hint="voice cloning is not served: leave the field out",
    )


def check_omni(body: Mapping[str, Any], spec: ModelSpec) -> Mapping[str, Any]:
    """Refuse voice cloning where the model does not clone (naming it), spell `language` as the
    model does, and read a boolean given for one of the model's string options as "true"/"false"."""
    for name in CLONING_FIELDS if spec.reference_sample_rate <= 0 else ():
        if body.get(name) not in (None, ""):
            voices = ", ".join(spec.voices)
            raise BadRequest(
                f"field {name!r}: model {spec.name} does not clone voices (ref_audio, ref_text); "
                f"leave them out and choose one of its voices: {voices}",
                param=name,
                code="unsupported_value",
            )
    body = dict(body)
    language = body.get("language")
    if isinstance(language, str):
        match = next((n for n in ("auto", *spec.languages) if n.lower() == language.strip().lower()), None)
        if match is not None:
            body["language"] = match
    task = body.get("task_type")
    spelled = {t.lower(): t for t in TASK_TYPES}
    if isinstance(task, str) and task.lower() in spelled:
        body["task_type"] = spelled[task.lower()]
    typed = {f.name for f in omni_fields(spec)}  # these fields have their own types (non_streaming_mode)
    for name in spec.options:
        if name not in typed and isinstance(body.get(name), bool):
            body[name] = "true" if body[name] else "false"
    return body


def streaming_choice(v: Mapping[str, Any]) -> bool:
    """`streaming` or `stream` (true when neither is given); a clash is a 400."""
    streaming, stream = v["streaming"], v["stream"]
    if streaming is not None and stream is not None and streaming != stream:
        raise BadRequest(
            f"stream {show(stream)} and streaming {show(streaming)} disagree; give one of them",
            param="stream",
        )
    for value in (streaming, stream):
        if value is not None:
            return bool(value)
    return True


def language_option(v: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The model option a named language becomes ("auto" and absent: none)."""
    language = v["language"]
    return () if language in (None, "auto") else (("language", language),)
