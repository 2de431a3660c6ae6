"""The voxpipe gateway: the HTTP front door (aiohttp) of the worker pipeline.

`build_app(cfg)` gives the aiohttp application; `python -m gateway --config-json ...` runs it.
The gateway never imports torch: model constants come from `programs.get_spec`.

Modules: `server` (the Gateway: sockets, inbox, /generate, /health, /ready, /metrics), `openai`
(/v1/audio/speech, /v1/models), `openapi` (/openapi.json), `fields` + `validation` (the request
field tables and their checks), `segments` (long text: splitting and joining), `synthesis` (one
request's segments as one event stream), `respond` (streamed, whole or SSE responses), `encoders`
(wav, pcm, flac, mp3, opus), `metrics` (Prometheus), `procs` (/ready), `body`, `events`, `wav`.
"""

from gateway.server import IDLE_TIMEOUT_S, Gateway, build_app
from gateway.validation import BadRequest, GenerateParams, parse_generate
from gateway.wav import wav_file, wav_header

__all__ = [
    "IDLE_TIMEOUT_S",
    "BadRequest",
    "Gateway",
    "GenerateParams",
    "build_app",
    "parse_generate",
    "wav_file",
    "wav_header",
]
