"""The voxpipe gateway: the HTTP front door (aiohttp) of the worker pipeline.

`build_app(cfg)` gives the aiohttp application; `python -m gateway --config-json ...` runs it.
The gateway never imports torch or `programs`: model facts come from the `ModelSpec` that the
tokenizer workers announce.

Modules: `pipeline` (the pipeline client: sockets, inbox, requests in flight, the model's spec),
`server` (the HTTP app: /generate, /health, /ready, /metrics, and the routes below), `openai`
(/v1/audio/speech, /v1/models), `openapi` (/openapi.json), `fields` + `validation` (the request
field tables and their checks), `segments` (long text: splitting and joining), `synthesis` (one
request's segments as one event stream), `respond` (streamed, whole or SSE responses), `encoders`
(wav, pcm, flac, mp3, opus), `metrics` (Prometheus), `procs` (/ready), `body`, `events`, `wav`;
voice cloning: `clips` (a reference clip decoded and resampled), `references` (its encoding by the
codec_workers, cached and shared), `cloning` (a request's cloned voice), `voices` + `voice_api`
(saved voices, /v1/audio/voices).
"""

from gateway.pipeline import IDLE_TIMEOUT_S, Pipeline
from gateway.server import build_app
from gateway.validation import BadRequest, GenerateParams, parse_generate
from gateway.wav import wav_file, wav_header

__all__ = [
    "IDLE_TIMEOUT_S",
    "BadRequest",
    "Pipeline",
    "GenerateParams",
    "build_app",
    "parse_generate",
    "wav_file",
    "wav_header",
]
