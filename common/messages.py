"""Every message that crosses a process boundary, and nothing else.

Each socket carries one tagged union (see the `*Msg` aliases at the bottom), so a receiver has one
decoder and one `match`. Structs are `array_like` msgpack: field order is the wire format, so new
fields go last and carry defaults. Arrays travel as raw little-endian bytes next to their shape
(`tokens`, `pcm`); no pickle anywhere.
"""

from __future__ import annotations

import enum

import msgspec

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)


class FinishReason(enum.IntEnum):
    STOP = 0  # the model emitted a stop token
    LENGTH = 1  # max_tokens (prompt included) or the context limit was reached
    ABORT = 2  # the client went away or the gateway cancelled it
    ERROR = 3  # a worker failed the request; `message` says why


class ProcState(enum.IntEnum):
    STARTING = 0
    LOADING = 1
    READY = 2
    STOPPING = 3
    FAILED = 4


class SamplingParams(msgspec.Struct, **_STRUCT):
    """Per-request sampling settings, already validated and filled with model defaults."""

    temperature: float = 0.6  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = -1  # last N tokens (prompt included); -1 = whole context
    seed: int = 0
    max_tokens: int = 1200  # prompt included, as in the reference
    min_tokens: int = 0  # stop tokens are masked until this many tokens were generated
    constrained: bool = False  # keep every sampled token a valid code for its frame position


class GenerateRequest(msgspec.Struct, tag="gen", **_STRUCT):
    """gateway → tokenizer_worker: build this request's prompt."""

    rid: str
    text: str
    sampling: SamplingParams
    model_kwargs: dict[str, str] = {}
    arrival: float = 0.0  # gateway's time.time() when the request was accepted
    # A later segment of a long text whose audio is already playing: it goes ahead of new requests
    # in the tokenizer pool, the gpu dispatch and the gpu_worker's admission, so the stream does not
    # wait behind arrivals that have nothing playing yet. Each admitted stream has at most one
    # segment in flight, so urgent work never exceeds the streams already admitted.
    urgent: bool = False
    # Size the prompt instead of building it: the tokenizer worker answers with the `PromptSize` of
    # this request's model options (the gateway asks before it cuts a long text into segments, for
    # options that add prompt rows: ModelSpec.sized_options, or a cloned voice).
    size_only: bool = False
    # A cloned voice (a reference clip's features, or a saved voice): the program's preprocess
    # receives it as `Voice(features, text)`.
    voice: VoiceFeatures | None = None
    # Native input streaming (ModelSpec.append_rows > 0): `text` is the input's first part, more
    # follows as `Appends` to the gpu_worker holding the request, until one with `end`.
    open_input: bool = False


STATE_DTYPES = ("<i4", "<f4")  # what a prompt's state arrays may hold: int32, float32


class Array(msgspec.Struct, **_STRUCT):
    """One named array of a prompt's state (programs.base, "Rows and per-request state"): raw
    little-endian bytes of a row-major array of one of STATE_DTYPES."""

    dtype: str
    shape: list[int]
    data: bytes

    def error(self) -> str:
        """Why the bytes are not such an array ("" when they are)."""
        if self.dtype not in STATE_DTYPES or len(self.shape) > 4 or any(n < 0 for n in self.shape):
            return f"a {self.dtype!r} array of shape {self.shape}"
        size = 4
        for n in self.shape:
            size *= n
        return "" if len(self.data) == size else f"{len(self.data)} bytes for shape {self.shape}"


class VoiceFeatures(msgspec.Struct, **_STRUCT):
    """An encoded reference clip: the program's `encode_references` features by name (int32 or
    float32 arrays), and what the clip says ("" when unknown)."""

    features: dict[str, Array]
    text: str = ""

    def error(self) -> str:
        """Why an entry is not an array ("" when all are)."""
        for name, array in self.features.items():
            error = array.error()
            if error:
                return f"feature {name!r}: {error}"
        return ""


class EncodeRequest(msgspec.Struct, tag="enc", **_STRUCT):
    """gateway → codec_worker: encode a reference clip (the program's `encode_references`). `key`
    names the clip (the hash of its audio), which the reply carries back."""

    key: str
    audio: Array  # "<f4" [S] mono in [-1, 1] at the model's reference_sample_rate
    text: str = ""


class EncodeReply(msgspec.Struct, tag="encd", **_STRUCT):
    """codec_worker → gateway: the clip `key`'s features, or why it could not be encoded
    (`status` the HTTP status: 400 for a clip the encoders refuse, 500 for their failure)."""

    key: str
    features: dict[str, Array] = {}
    error: str = ""
    status: int = 0


class Prompt(msgspec.Struct, tag="prompt", **_STRUCT):
    """tokenizer_worker → gateway → gpu_worker: a built prompt, int32 rows of n_codebooks ids (the
    gateway hands it to a gpu_worker with free capacity, see `common.pool`)."""

    rid: str
    tokens: bytes  # int32 little-endian, [n_rows, n_codebooks] row-major
    n_rows: int
    sampling: SamplingParams
    arrival: float = 0.0
    urgent: bool = False  # as GenerateRequest.urgent
    # The program's per-request state besides the rows (PromptRows.state), by name.
    state: dict[str, Array] = {}
    open_input: bool = False  # as GenerateRequest.open_input: more text follows as Appends

    def shape_error(self, n_codebooks: int) -> str:
        """Why `tokens` is not `n_rows` rows of n_codebooks int32 ids, or a state entry not an
        array ("" when all are): the one check a process that takes a Prompt off the wire makes
        before reading it (the tokenizer worker checks the rows it builds in full: shape, id
        range, length; the gpu_worker's program vets the state's contents)."""
        if self.n_rows < 0 or len(self.tokens) != 4 * n_codebooks * self.n_rows:
            return f"{len(self.tokens)} bytes for {self.n_rows} rows of {n_codebooks} int32 ids"
        for name, array in self.state.items():
            error = array.error()
            if error:
                return f"state {name!r}: {error}"
        return ""


class TextPiece(msgspec.Struct, **_STRUCT):
    """A part of an open request's input to tokenize: `text` is the piece held back last time and
    what the client appended since; `final`: nothing may follow it (the input ended, or a flush),
    so none of it is held back."""

    rid: str
    seq: int
    text: str
    final: bool = False


class AppendText(msgspec.Struct, tag="appt", **_STRUCT):
    """gateway → tokenizer_worker: the pieces of open requests' input that arrived since the last
    such message (one per gateway tick, whatever the number of sessions)."""

    pieces: list[TextPiece]


class TextRows(msgspec.Struct, **_STRUCT):
    """A tokenized `TextPiece`: `taken` (the piece's text whose tokens are final) as the program's
    state rows (`append`), and `held`, the text held back until more follows (its tokens may
    change). `error` and `status` (an HTTP status) when the program refused the piece."""

    rid: str
    seq: int
    state: dict[str, Array] = {}
    n_rows: int = 0
    taken: str = ""
    held: str = ""
    error: str = ""
    status: int = 0


class AppendedText(msgspec.Struct, tag="appd", **_STRUCT):
    """tokenizer_worker → gateway: the answer to one `AppendText`, piece by piece."""

    items: list[TextRows]


class Append(msgspec.Struct, **_STRUCT):
    """State rows appended to an open request (`n_rows` of them in `state`); `end`: its input has
    ended with these."""

    rid: str
    state: dict[str, Array] = {}
    n_rows: int = 0
    end: bool = False


class Appends(msgspec.Struct, tag="apnd", **_STRUCT):
    """gateway → the gpu_worker holding the requests: every append for it since the last such
    message (one per gateway tick), in arrival order."""

    items: list[Append]


class PromptSize(msgspec.Struct, tag="psize", **_STRUCT):
    """tokenizer_worker → gateway: the answer to a `size_only` GenerateRequest: the prompt rows the
    request's model options add beyond ModelSpec.prompt_overhead (the program's `option_rows`)."""

    rid: str
    rows: int


class Abort(msgspec.Struct, tag="abort", **_STRUCT):
    """gateway → every gpu_worker: stop these requests and free their KV pages and slots (a worker
    that does not hold a rid keeps a bounded tombstone for it). `everything`: stop every request the
    worker holds: a new gateway greets each gpu_worker with it, since whatever a worker still runs
    then belongs to a gateway that is gone."""

    rids: list[str]
    everything: bool = False


class DetokChunk(msgspec.Struct, **_STRUCT):
    """One codec window of a request: `index` counts the request's chunks from 0 (the order the
    gateway plays them in). `noise_id` names the window's noise stream, so a window's audio does
    not depend on which chunks came before it: regular window j (rows [j*s, j*s + interval)) has
    noise_id j; a lead window of R rows (the program's `detok_lead`) has LEAD_NOISE_BASE + R."""

    rid: str
    index: int
    seed: int
    tokens: bytes  # int32 little-endian, [rows, n_codebooks]: detok_interval rows, or a lead size
    noise_id: int = 0
    # > 0: a *tail* window (programs/base.py, "Progressive first chunks"): only the audio of its
    # last tail_rows rows is wanted.
    tail_rows: int = 0
    # Unused: it holds slack_ms's place on the wire (field order is the wire format). Always 0.
    reserved: int = 0
    # How long the listener can wait for this window when it leaves the gpu_worker: audio sent
    # before it minus audio played since the first chunk (0: a first chunk, or a stream running
    # late). The codec worker gathers windows for one batch within it (codec_worker/gather.py).
    slack_ms: float = 0.0
    # Chunk 0 of a primed stream: int32 little-endian [P, n_codebooks], the rows its codec stream
    # decodes first, their audio dropped (the program's `codec_prefix`; programs/base.py, "Codec
    # streams"). Empty: the stream starts fresh.
    prefix: bytes = b""
    # >= 0: the chunk is in the window group (programs/base.py, "Window groups") whose first chunk
    # has this index; the codec worker merges it with that group's chunks only. -1: no group.
    group: int = -1
    # Chunk 0 of a voiced stream (the program's `codec_voice`; programs/base.py, "Codec streams"):
    # the arrays its codec slot is conditioned on. Empty: the codec's default voice.
    voice: dict[str, Array] = {}


LEAD_NOISE_BASE = 1 << 40  # noise ids of lead windows start here, far above any regular window


class Finished(msgspec.Struct, **_STRUCT):
    rid: str
    reason: FinishReason
    n_tokens: int = 0  # generated tokens, prompt excluded
    n_chunks: int = 0  # audio chunks sent for this request
    message: str = ""
    status: int = 0  # HTTP status the gateway should answer with when reason is ERROR
    n_prompt_tokens: int = 0  # prompt rows the request was admitted with


class DetokBatch(msgspec.Struct, tag="detok", **_STRUCT):
    """gpu_worker → codec_worker: every chunk that became ready in one step, then who finished."""

    chunks: list[DetokChunk]
    finished: list[Finished] = []
    step: int = 0


class AudioChunk(msgspec.Struct, **_STRUCT):
    rid: str
    index: int
    pcm: bytes  # int16 little-endian mono at the model's sample rate; empty when the codec
    # dropped the window (the reference does this for invalid codes)


class AudioChunks(msgspec.Struct, tag="audio", **_STRUCT):
    """codec_worker → gateway: one message per codec batch; `finished` follows the chunks."""

    chunks: list[AudioChunk]
    finished: list[Finished] = []


class RequestError(msgspec.Struct, tag="reqerr", **_STRUCT):
    """tokenizer_worker → gateway: a request failed before its prompt was built (a gpu_worker's refusals
    travel as `Finished` with reason ERROR, through the codec_worker)."""

    rid: str
    status: int  # HTTP status: 4xx for the client's mistakes, 5xx for ours
    message: str


class ProcStatus(msgspec.Struct, tag="status", **_STRUCT):
    """Every process → gateway, on each state change and as a heartbeat."""

    name: str  # e.g. "gpu_worker", "tokenizer_worker.1"
    role: str
    pid: int
    state: ProcState
    detail: str = ""
    time: float = 0.0
    load: int = 0  # requests in flight (gpu_worker), queued prompts (tokenizer_worker)
    capacity: int = 0
    # Gauges and counters for /metrics, e.g. gpu_worker: kv_pages_used, kv_pages_total,
    # decode_batch_size, queue_depth, generated_tokens_total, steps_total.
    metrics: dict[str, float] = {}
    # The sender's host and PID namespace (`common.proc.host_id`): a gateway with the same one can
    # look at `pid` itself, so a process that exited fails its requests at once and a slow one never.
    host: str = ""


class ModelSpec(msgspec.Struct, tag="spec", **_STRUCT):
    """tokenizer_worker → gateway: every fact about the served model that the gateway needs, from
    the model's program (`LMProgram.model_spec`), so the gateway never imports `programs` or torch.
    A tokenizer worker sends it when it is ready and again every few seconds (a restarted gateway
    learns it within that time; until then it answers speech requests with 503)."""

    name: str  # the served --model name, as the client gives it
    aliases: list[str]  # the registry's other names for the same model
    voices: list[str]
    default_voice: str
    sample_rate: int  # Hz of the PCM16 the codec_worker sends
    rows_per_second: float  # generated rows per second of audio (the real-time pace of a stream)
    max_tokens: int  # a generation's token budget, prompt included (the model's context)
    vocab_size: int  # sampleable ids of codebook 0: top_k's upper bound
    # Rows a prompt holds besides its text's tokens (special ids, the template around the text for
    # the longest voice), with no model options: a prompt of a text of b UTF-8 bytes has at most
    # prompt_overhead + b rows (byte-level tokenizers), which is how long texts are cut.
    prompt_overhead: int
    window_rows: int  # rows of one codec window: the least audio a segment of a long text has room for
    sampling: SamplingParams  # the model's sampling defaults (seed and max_tokens unused)
    constrained: bool = False  # constrained sampling by default (--constrained overrides)
    constrainable: bool = False  # the model has a constrained sampling mode
    # The model's own request options: name → description (string fields of both endpoints, passed
    # to the program's preprocess as model_kwargs).
    options: dict[str, str] = {}
    # Request fields of OpenAI's API the model cannot honour → why, said in the 400 (e.g. "speed",
    # "instructions"); a field not listed here goes to the program as a model option.
    refused: dict[str, str] = {}
    n_codebooks: int = 1  # ids per prompt row (Prompt.shape_error)
    # Options whose value adds prompt rows (a conversation context): a request that sets one is
    # sized by the tokenizer pool (GenerateRequest.size_only) before its text is cut into segments.
    sized_options: list[str] = []
    # The languages a request's `language` may name (besides "auto", always accepted), as the model
    # spells them; the program receives a named one as model_kwargs["language"]. Empty: the model
    # takes no language, and a request may only say "auto".
    languages: list[str] = []
    # > 0: the model clones voices from reference clips resampled to this rate (the program's
    # reference_sample_rate); 0: a request with a clip or a saved voice gets a 400.
    reference_sample_rate: int = 0
    voice_required: bool = False  # a request without a voice or a clip gets a 400 (LMProgram.voice_required)
    # > 0: the model takes text appended to a running request (native input streaming, the
    # program's `appends_text`), at most this many state rows of it per request; 0: it does not.
    append_rows: int = 0
    # The model options that put a request in the mode that takes appended text (a session whose
    # options say otherwise is served by segmentation).
    append_options: dict[str, str] = {}


# One union per receiving socket.
GpuInMsg = Prompt | Abort | Appends
TokenizerInMsg = GenerateRequest | AppendText
CodecInMsg = DetokBatch | EncodeRequest
GatewayInMsg = (
    AudioChunks | RequestError | ProcStatus | Prompt | ModelSpec | PromptSize | EncodeReply | AppendedText
)


# --- Pool control and taps --------------------------------------------------------------------


class WorkerReady(msgspec.Struct, tag="wready", **_STRUCT):
    """pool worker → dispatcher: "I am free, send me one message". `seq` counts the messages the
    worker has received, so the dispatcher can tell a stale announcement (one that crossed a message
    on the wire) from a fresh one; a worker repeats it while idle, which also re-registers it with
    a restarted gateway.

    `credits`: how many more messages the worker can take after the `seq` it has received (1 for a
    tokenizer worker; free slots for a gpu_worker, 0 when full); the dispatcher subtracts what it
    sent since `seq`."""

    name: str = ""
    seq: int = 0
    credits: int = 1


class WorkerLeaving(msgspec.Struct, tag="wleave", **_STRUCT):
    """pool worker → dispatcher: send me nothing more; answer with `LeaveAck`."""

    name: str = ""


class LeaveAck(msgspec.Struct, tag="wbye", **_STRUCT):
    """dispatcher → pool worker: nothing more is on its way to you (anything sent earlier arrives
    before this), so you may exit."""

    name: str = ""


class StageEvent(msgspec.Struct, tag="stage", **_STRUCT):
    """Published on a tap only, never on a pipeline socket: a point in a request's life that no
    wire message marks (gpu_worker "admitted" / "first_token", gateway "first_byte_sent")."""

    rid: str = ""
    stage: str = ""
    time: float = 0.0  # time.time() of the event in the publishing process
    detail: dict[str, str | int | float] = {}


class TapHeader(msgspec.Struct, **_STRUCT):
    """First frame of every message on a tap; the second frame is the message exactly as sent."""

    proc: str = ""  # the publishing process's name
    time: float = 0.0  # time.time() just before the message was sent
    addr: str = ""  # the socket it was sent on ("" for a StageEvent)
    peer: str = ""  # for a dispatched message: the pool worker that took it


PoolWorkerMsg = WorkerReady | WorkerLeaving  # pool worker → dispatcher
# Everything a tap can carry: one decoder for `voxpipe tap`.
TapMsg = (
    GenerateRequest
    | Prompt
    | Abort
    | DetokBatch
    | AudioChunks
    | RequestError
    | ProcStatus
    | StageEvent
    | ModelSpec
    | EncodeRequest
    | EncodeReply
    | AppendText
    | AppendedText
    | Appends
)
