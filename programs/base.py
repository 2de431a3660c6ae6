"""The program contract: what a model supplies so that the runtime can serve it.

A program is written once and never sees sockets or requests, only rows and batch entries. Loading
is split by process: the gpu_worker calls `load_lm`, the codec_worker `load_codec`, and the
tokenizer_worker neither (prompts read only `spec`, and the text tokenizer). The tokenizer_worker
also announces the model to the gateway (`model_spec`), which never imports `programs`.
A model's modules import shared code from `programs.blocks`, never from another model's folder.

Hooks, with shapes (N = token rows this step, B = requests this step, C = n_codebooks,
V = vocab_size, H = hidden size). "graph" marks code the GPU runtime captures in CUDA graphs: no
host synchronization (.item(), .cpu(), .tolist(), Python `if` on tensor values), static shapes
apart from N/B/Bd, state only in buffers, randomness only from the keys passed in.

| hook | process | graph | shapes |
|---|---|---|---|
| `load_lm()` | gpu_worker | no | sets the LM constants below |
| `load_codec()` | codec_worker | no | sets the codec constants below |
| `embed(ids, rows)` | gpu_worker | yes | ids [N, C] int64, rows `Rows` (slot, step [N]; prompt_rows) → [N, H] |
| `backbone(hidden, pos, attn)` | gpu_worker | yes | [N, H], pos [N] int64 → [N, H]; attention through `attn` |
| `head(hidden)` | gpu_worker | yes | [B, H] → logits [B, C', V] float32 (V' columns when `head_ids` is set); the runtime samples codebook 0 |
| `guide(logits, slot)` | gpu_worker | yes | [B, 2, C', V] float32 (conditional, unconditional), slot [B] int64 → [B, C', V] (only with `guidance`) |
| `decode_tokens(hidden, c0, sample, rows)` | gpu_worker | yes | [B, H], [B] int64, `Rows` (slot, step, prev [B, C]) → row [B, C] int64 (only when C > 1) |
| `compile_depth(enabled)` | gpu_worker | no | optional: put `decode_tokens`' compilable pieces under torch.compile (--depth-compile) → whether it has any |
| `fuse_layers()` | gpu_worker | no | optional: after `load_lm`, run the LM's layers in fused GPU kernels (--fused-step on; same math in another rounding order, every kernel row-wise) → whether it did |
| `init_state(num_slots)` | gpu_worker | no | optional: allocate per-request state buffers [num_slots, …] (see Per-request state) |
| `check_prompt(rows, state)` | gpu_worker | no | a prompt's rows [R, C] and state arrays → "" or why they are not what `preprocess` builds |
| `admit(slot, state)` | gpu_worker | no | write a starting request's state into its slot's buffers |
| `codec_prefix(state)` | gpu_worker | no | a request's state arrays → rows [P, C] int32 its codec stream starts with, or None (the default; see Codec streams) |
| `codec_voice(state)` | gpu_worker | no | with `codec_voices`: a request's state arrays → the arrays its codec stream is conditioned on (name → int32/float32 array), or None: the codec's default voice (see Codec streams) |
| `candidates(n_audio)` | gpu_worker | yes | [B] int64 → [B, K] int64 token ids (constrained sampling) |
| `classify(tokens, n_audio)` | gpu_worker | yes | [B, C] int64, [B] int64 → kinds [B] int64 (TokenKind) |
| `detokenize(tokens, keys, tail_rows=0, streams=None)` | codec_worker | yes | [Bd, R, C] int64 (R = detok_interval, or one of `detok_lead`, or a codec prefix's P), keys [Bd] int64 → audio [Bd, S] float in [-1, 1] (S = detok_samples for a regular window, R / s * detok_samples for a lead window, tail_rows / s * detok_samples for a tail window), valid [Bd] bool; `streams` (a `CodecStreams`) only with `codec_streams` |
| `init_codec_streams(n_slots)` | codec_worker | no | with `codec_streams`: allocates the state of n_slots codec slots on the codec's device (see Codec streams) |
| `prime_codec_streams(tokens, keys, slots)` | codec_worker | no | with `codec_streams` and a `codec_prefix`: [B, P, C] int64 rows, keys [B], slots [B] int64 → None; starts each slot's stream with its rows, audio dropped (default: one fresh `detokenize` call; see Codec streams) |
| `set_codec_voice(slot, voice)` | codec_worker | no | with `codec_voices`: writes a stream's conditioning (name → tensor on the codec's device, or None: the default voice) into codec slot `slot` before its first window (see Codec streams) |
| `compiled_detokenize()` | codec_worker | — | optional: a function equal to `detokenize(tokens, keys)` for regular windows (with `codec_streams`: `detokenize(tokens, keys, streams=…)` for regular and merged windows; with `codec_compiled_tails`: also `detokenize(tokens, keys, tail_rows=detok_stride)` for the tail windows of a regular window's rows; with `codec_compiled_leads`: also lead windows of those sizes), compiled (`torch.compile`), or None (the default): the codec_worker captures it in those windows' graphs (`--codec-compile`, `--codec-compile-tails`, `--codec-compile-leads`) |
| `load_encoders()` | codec_worker | no | with `reference_sample_rate`: loads what `encode_references` needs (see Reference audio) |
| `encode_references(clips)` | codec_worker | no | `Reference`s (mono float32 audio at `reference_sample_rate`, its text) → one `Voice.features` dict per clip, batched |
| `preprocess(text, model_kwargs, voice=None)` | tokenizer_worker | no | → prompt rows [R, C] int32, or `PromptRows` (rows and state arrays); `voice` a `Voice` (a cloned voice) or None; ValueError → HTTP 400 |
| `prompt_overhead()` | tokenizer_worker | no | → prompt rows besides the text's tokens (no options) |
| `option_rows(model_kwargs, voice=None)` | tokenizer_worker | no | → prompt rows the `sized_options` (and a cloned `voice`) add; ValueError → HTTP 400 |
| `model_spec(served)` | tokenizer_worker | no | → `ModelSpec`, the facts the gateway serves the model by |
| `take_text(text, final)` | tokenizer_worker | no | with `appends_text`: → (the part of `text` whose tokens are final, the rest held back) |
| `append(text)` | tokenizer_worker | no | with `appends_text`: taken text → state rows (name → [k, …] array) |
| `appended_rows(state)` | both | no | with `appends_text`: how many appendable rows a prompt's or an append's state holds |
| `check_append(state)` | gpu_worker | no | with `appends_text`: "" or why an append's state is not what `append` builds |
| `extend(slot, state, start)` | gpu_worker | no | with `appends_text`: write an append's rows into the slot at rows [start, start + k) |
| `open_steps(n_rows)` | gpu_worker | no | with `appends_text`: steps a request with n_rows appended rows may launch while its input is open |

Attributes a program sets (defaults on LMProgram; any model may use each):

| attribute | meaning |
|---|---|
| `n_codebooks`, `vocab_size`, `num_layers`, `num_qo_heads`, `num_kv_heads`, `head_dim`, `hidden_size` | LM shapes, from the config (weight-free programs know them too) |
| `input_vocab_size` | prompt ids lie in [0, input_vocab_size) (above vocab_size when prompt rows carry text ids) |
| `detok_interval`, `detok_overlap`, `detok_samples`, `detok_offset` | codec windows (Audio chunks) |
| `detok_lead`, `detok_tail` | lead windows, tail windows (below) |
| `codec_compiled_tails` | `compiled_detokenize`'s function also takes the tail windows of a regular window's rows (`tail_rows = detok_stride`) |
| `codec_compiled_leads` | the lead window sizes (rows of `detok_lead`) that `compiled_detokenize`'s function also takes, decoded whole (each one more compile at startup) |
| `codec_dtype`, `head_ids` | codec precision, output heads (below) |
| `codec_call_batch`, `codec_max_batch` | windows per codec call and per codec pass (None: the codec_worker's defaults): a codec whose lone window fills the device decodes in calls of one |
| `uses_repetition_penalty` | False: the model has none; requests' repetition_penalty is ignored |
| `mixed_prefill` | every GEMM of `backbone` goes through `programs.blocks.fp8.linear`, so a prompt may ride in one forward pass with a decode step |
| `sized_options` | request options whose value adds prompt rows, counted by `option_rows` |
| `config_dir` | the folder of the shipped configs the spec names (`lm_config`, `codec_config`): `lm_weights(cls)` and `codec_model(cls)` build random weights from them (`--load-format dummy`) or load the checkpoint; `load_prompts()` loads the text tokenizer |
| `codec_streams` | the codec keeps per-request state and decodes each audio row once (see Codec streams) |
| `codec_voices` | with `codec_streams`: each stream is conditioned on its request's voice, kept per codec slot (`codec_voice`, `set_codec_voice`; see Codec streams) |
| `codec_merge` | with `codec_streams`: how many consecutive windows of a stream may decode as one window (see Codec streams) |
| `detok_silent` | a stream's first windows that yield no audio (a look-ahead, a delay pattern): sent at once, the listener's clock starts after them |
| `detok_first_windows` | a stream's first audible windows held and sent together (short windows: the listener starts with their audio in hand) |
| `detok_groups` | with `codec_streams`: the later audible windows sent and decoded in groups of these sizes, whatever the timing (see Codec streams, window groups) |
| `voice_required` | a request without a voice (a saved one or a clip) is refused: the model has no voice of its own |
| `guidance` | every request runs a conditional and an unconditional sequence (see Classifier-free guidance) |
| `serve_defaults` | a spec key (torch-free: options resolve before any program loads): settings the model serves with unless a flag or variable sets them (option field → value, e.g. `{"fused_step": "on"}`), those it serves best with as measured (`common.options.model_defaults`; `voxpipe models` lists them) |

Multi-codebook rows (C > 1): a row is one frame of C codebook ids (a program may also encode
non-audio rows in it, e.g. a text token, as long as `embed` tells them apart; prompt ids must lie
in [0, input_vocab_size)). The runtime samples codebook 0 from `head(...)[:, 0]` with the request's
sampler (repetition penalty, min_tokens, top-k/p, seed), then calls `decode_tokens` with the
backbone's last hidden state of each request: it returns the whole row, codebook 0 included, e.g.
by running a depth transformer for codebooks 1..C-1. It is captured like the backbone (fixed
shapes, no host sync) and draws every random number through `sample(logits [B, V], salt)`, the
runtime's sampler with the request's temperature/top-k/top-p/min-p and a stream keyed by (seed,
salt, tokens generated): no repetition penalty or stop masking, and a different salt per call, so a
request samples the same row in any batch. The full row is fed back as the next input on the device
and handed to `classify`. With C = 1 the runtime does not call `decode_tokens`.

Rows and per-request state: `embed` and `decode_tokens` see where each row belongs (`Rows`):
`slot` [N], the request's slot (0..num_slots-2; padding rows of a captured step may name any slot
and their output is dropped), and `step` [N], the row's place in its request: prompt rows are
-R..-1 (R prompt rows), the first generated row is 0 (in `embed`: the fed-back row of generated row
`step`; in `decode_tokens`: the row being sampled). `decode_tokens` also gets `prev` [B, C], the
request's previous row (the last prompt row for its first sample). A program whose step needs more
than the row's ids (a text column that advances with the frames, a speaker vector in place of a
prompt row) keeps it as per-request state: `init_state(num_slots)` allocates buffers indexed by
slot on `self.device` (the last slot is the runtime's scratch slot, never a request's),
`preprocess` returns `PromptRows(rows, state)` with named int32/float32 arrays, which travel with
the prompt, `check_prompt` vets them (and the rows) when the prompt reaches the gpu_worker (a non-empty answer
fails the request with a 400), and `admit(slot, state)` writes them into the slot when the request
starts (host side, before its first step, without waiting for the device: copy from pinned
memory). `embed` and `decode_tokens` only read the state, indexed by `rows.slot`, so a captured
step reads each request's own. Captured steps read the buffers `init_state` made before their
capture, so a program object serves one engine with graphs (the runtime refuses new requests when
another `init_state` replaced them: `ModelRunner.check_state`). A program without state keeps the
defaults (no buffers, no arrays).

Prompt rows first: a step lays its new requests' whole prompts first, then one fed-back row per
decoding request, and `embed` sees where the prompt rows end as a plain int, `rows.prompt_rows`:
rows [0, prompt_rows) are prompt rows, the rest generated rows (padding rows of a captured step
count with their part: a prefill graph's as prompt rows, a decode graph's as generated rows). It is
fixed when the step is built or captured (0 in decode graphs and eager decode-only steps, N in
prefill graphs, the prefill bucket's rows in mixed graphs), so a program may run work that only one
kind of row needs on static slices (e.g. separate feed-forward weights for prompt and generated
rows: a decode step then reads only the generated rows'); `backbone` runs in the same forward pass
right after `embed`, so a program may keep it for `backbone`. None where the caller does not say
(`step` alone tells the rows apart).

Audio chunks: the runtime counts the rows classified AUDIO per request (`n_audio`). Chunk j holds
audio rows [j*s, j*s + detok_interval) with s = detok_interval - detok_overlap and is sent to the
codec as soon as row j*s + detok_interval - 1 exists; each chunk returns only the samples it adds
(`detok_samples`). A chunk whose `valid` is False yields no audio (the reference drops such
windows). `keys` are per-chunk noise seeds derived from the request's seed and the chunk index, so
a seed fixes the audio as well as the tokens.

Lead windows (for a fast first chunk): `detok_lead` lists the row counts R a request's first
chunk may have instead (() when the program has none). A lead window holds audio rows [0, R),
R a multiple of s, and `detokenize` returns all of their audio, R / s * detok_samples samples
(one call sees one R for every entry; the codec_worker groups chunks by row count).
`detok_samples` stays the regular window's count.

Progressive first chunks (`detok_tail`, `--first-chunk progressive`): a request's first frames each
go out as a *tail window*: rows [max(0, n - detok_interval), n) at every s-th audio row n, with
`tail_rows` = s, for which `detokenize` returns only the audio of the last s rows (the newest
frame, decoded with up to detok_interval - s rows before it and nothing after). Once the audio
already sent covers the wait for the next regular window (its steps at the step budget or the
pessimistic pace, whichever is slower), the runtime switches to regular windows for good; the
frames sent as tails are not sent again.

The codec's precision is `codec_dtype` (the `codec_dtype` keyword: "auto" keeps the program's
choice, else float32, bfloat16 or float16), read by `load_codec`.

Output heads: a program may compute logits for a subset of its vocabulary (`lm_head="audio"`:
only the tokens a speech stream can use). It then sets `head_ids` [V'] int64, the token id of each
logits column; the runtime samples over those columns (penalties, stop masks and candidates are
mapped onto them; tokens outside the head cannot be sampled) and hands token ids to every other
hook, as with a full head. `head_ids` None means the columns are the whole vocabulary.

Codec streams (`codec_streams = True`, for codecs whose output depends on everything decoded
before: a transformer's KV cache, causal-convolution history, transposed-convolution overlap):
each request's audio rows are decoded exactly once, in order, as one stream, so the streamed
audio equals the codec's decode of the whole utterance. The codec keeps each stream's state in a
*codec slot*. Such a program has detok_overlap 0 and no lead or tail windows.
- `init_codec_streams(n_slots)` (codec_worker, after `load_codec`) allocates n_slots slots on the
  codec's device. The runtime keeps the last slot (n_slots - 1) as a scratch slot: padding
  entries of a batch decode there, and it is never a request's.
- `detokenize(tokens, keys, streams=CodecStreams(slot, fresh))`: entry b decodes its R new rows
  `tokens[b]` [R, C] continuing the stream held in slot `slot[b]` [Bd] int64; `fresh[b]` [Bd] bool
  True means the window starts a stream, and the slot's state is reset first, inside the call and
  graph-safe (e.g. `torch.where(fresh, initial, state)`). It returns the window's audio
  [Bd, R / s * detok_samples] and valid as usual and leaves each slot's state advanced by R rows.
  It is captured per (R, batch bucket) with static slot and fresh buffers; one call never holds
  two entries of one real slot (padding entries may share the scratch slot).
- The runtime (codec_worker) gives a request's chunk 0 a free slot (fresh), its later chunks the
  same slot, decodes a request's chunks strictly in index order, one per call (or several as one
  merged window, below), and frees the slot at the request's end. A later chunk of a request without a slot (its state is lost: a restarted
  codec worker, a slot reclaimed from a stream idle too long) ends that request with an error.
- Merged windows (`codec_merge`, sizes m > 1, e.g. (2, 4, 8)): a request's m consecutive regular
  windows waiting together (a stream behind, the first audible windows sent together) may
  decode in one call of R = m·detok_interval rows, entry b continuing its stream as for one
  window. `detokenize` then returns audio [Bd, m·detok_samples], each window's samples in turn,
  and valid [Bd] or [Bd, m] (each window's), and its audio equals the m windows decoded one by
  one up to the codec's rounding; the noise key is the first window's (a program whose windows
  draw noise of their own leaves `codec_merge` empty). The runtime captures each such R like a
  window size of its own (`--codec-merge` caps m; 1: none).
- Window groups (`detok_groups`, e.g. (1, 2, 4)): for a codec whose merged window is not its
  windows decoded one by one (its attention sees the whole window: S3Gen), so that merging by
  timing would make the audio depend on load. The audible windows after the first
  `detok_first_windows` go out in groups of these sizes, the last size repeating: a group's
  windows wait in the gpu_worker until its last one exists, then leave together (the listener's
  audio in hand counts them from then), and the codec worker decodes each group as one merged
  window, never merging across groups: a stream's audio is then a function of its rows and its
  seed. A request's end sends the windows of its last group that exist (a shorter group, decoded
  as merged windows of `codec_merge` sizes, largest first). Each size is captured whatever
  `--codec-merge` says. Larger later groups make a second of audio cheaper where a window's cost
  barely grows with its rows, at the price of the stream's lead: a group of m windows leaves
  when its last window's rows exist, so the LM must stay ahead of playback. The runtime paces
  admission for it (the step budget divided by the pace the groups need, 1.75 times real time
  for (1, 2, 4)), counts the rows a stream's group still needs in the lead by which it may sit
  steps out, and refuses groups with appended text (finished windows would wait for text).
- Primed streams (`codec_prefix(state)`, gpu_worker, host side): rows [P, C] int32 that a request's
  stream decodes before its own audio rows, their audio dropped, or None (the default: a stream
  starts from the codec's initial state). It is for a reference whose codec decodes something
  before the generated rows as one utterance and cuts that audio off (a cloned voice's clip
  frames); it reads only the request's state (`preprocess`'s arrays, vetted by `check_prompt`).
  The gpu_worker sends the rows with the request's chunk 0 (`DetokChunk.prefix`); the codec_worker
  decodes them in the chunk's fresh slot first, `prime_codec_streams` [1, P, C], an eager call
  outside the graphs, before the chunk's own window, which then continues the stream (not fresh).
  The default is one fresh `detokenize` call of the P rows (so a program that keeps it takes any
  R ≥ 1 there); a program overrides it where that call is slow (a codec whose windows run in
  passes of a few rows). Each stream primes alone: a prefix costs its whole audio's decode, so a
  batch would share only the launch overhead, and alone the call's shape depends on P only, so a
  stream's audio does not depend on the streams primed with it.

- Voiced streams (`codec_voices = True`, for a codec conditioned on a speaker besides its rows:
  S3Gen's prompt tokens, their mel and an x-vector): `codec_voice(state)` (gpu_worker, host side)
  gives the arrays of a request's voice from its state (a cloned voice's codec features, vetted by
  `check_prompt`), or None for the codec's default voice. The gpu_worker sends them with the
  request's chunk 0 (`DetokChunk.voice`); the codec_worker calls `set_codec_voice(slot, voice)`
  (eager, queued on the codec's stream before the window, and before a prefix's priming) for every
  chunk 0 that takes a fresh slot, with None when the request has none, so a reused slot never
  keeps another request's voice. The program keeps the voices in slot-indexed buffers that its
  graphs read by slot; a window's audio then depends on its own request's voice alone.

Reference audio (voice cloning): a program that clones a voice from a reference clip sets
`reference_sample_rate` > 0 (0: it takes no audio; a request with a clip gets a 400). The clip's
encoders (a speaker embedding, the codec's encoder for reference codes, mel features) run in the
codec_worker, never in the LM's step loop: `load_encoders()` loads them after `load_codec`, and
`encode_references(clips)` encodes a batch of `Reference(audio [S] float32 mono at
reference_sample_rate, text)` into one `features` dict per clip (name → int32/float32 array). The
runtime caches them by content, stores saved voices as them, and hands them to `preprocess` as
`Voice(features, text)`, which builds the prompt from them: rows, and per-request state for what
rows cannot hold (float vectors, reference codes wider than a row). Encoders are deterministic and
depend on the audio alone; everything that depends on the request is `preprocess`'s.

Appended text (native input streaming, `appends_text = True`): a request may open with the first
part of its text and take the rest while it generates, as the text arrives (a voice agent's LLM
writing it). The program keeps the text as per-request state rows (its `preprocess` builds the
opening prompt, with the text so far as state); each appended part goes through the
tokenizer_worker: `take_text(text, final)` splits it into the part whose tokens are final and the
rest, held back until more follows (text that ends mid-word tokenizes differently once the word
goes on; `final` holds nothing back), and `append(taken)` turns the taken part into state rows
(name → array of k rows along axis 0; `appended_rows` counts them). In the gpu_worker, `extend`
writes them into the request's slot between steps (host side, graph-safe: copies queued on the
stream after the step in flight, rows the step in flight never reads) and `check_append` vets them
first; a request's rows never exceed `append_capacity`. While the input is open, a request that
has launched `open_steps(n)` steps with n rows sits out of the batch (no frames, no text column
read past what it has) and resumes when rows arrive; once the input has ended it runs as a request
whose whole text came with its prompt, so the same text gives the same tokens however it arrived.
`append_options` names the model options of the mode that takes appended text (the runtime sets
them on such requests; a client that asks for another mode is served otherwise).

Classifier-free guidance (`guidance = True`, for models that sample from a conditional and an
unconditional sequence: Chatterbox, CosyVoice, Zonos): `preprocess` returns 2R rows, the conditional
prompt's R rows then the unconditional prompt's R rows (`embed` tells the two apart by their ids).
The runtime splits them when the prompt arrives and runs each request as two KV sequences of one
slot: its pages split in half, the sequences side by side in every step (conditional first), both
at the same positions 0..R-1 and steps -R..-1, and both fed the same sampled row. The request's
token budget and repetition history are the conditional sequence's: max_tokens (and max_context)
count R prompt rows and the rows generated, each sequence holds that many, and `prompt_overhead`
and `option_rows` count the rows of one prompt. `guide(logits [B, 2, C', V], slot [B])` (graph) combines
each request's pair into the logits it samples from, [B, C', V] (e.g. cond + w·(cond − uncond), w
from per-request state); sampling then runs as for any request, so a request's rows do not depend
on its batch. The runtime's CUDA graphs hold both sequences of each request (a decode graph of B
requests runs 2B rows) and call `guide` inside them, so it is device work only.

Attention: `attn` is an `Attention` planned by the runtime for this step. Each layer calls
`attn.forward(layer, q, k, v)`: it writes the step's keys/values into the paged cache
[num_layers, num_pages, 2, page_size, num_kv_heads, head_dim] and returns each row's causal
attention over its request's context. Padding rows write to page 0 and their output is ignored.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

import programs
from common.messages import ModelSpec, SamplingParams

CODEC_DTYPES = ("float32", "bfloat16", "float16")
T = TypeVar("T")


class TokenKind(enum.IntEnum):
    OTHER = 0  # fed back to the LM, not decoded (interleaved text, dropped tokens)
    AUDIO = 1  # a row of codec tokens
    STOP = 2  # ends the request


@dataclass
class Rows:
    """Where the rows of a step belong (see "Rows and per-request state"), on the step's device."""

    slot: torch.Tensor  # [N] int64 the request's slot (a graph bucket's padding rows: the scratch slot)
    step: torch.Tensor  # [N] int64 prompt rows -R..-1, generated rows 0, 1, …
    prev: torch.Tensor | None = None  # [B, C] int64 the request's previous row (decode_tokens only)
    prompt_rows: int | None = None  # rows [0, prompt_rows) are prompt rows, the rest generated (embed only)


@dataclass
class PromptRows:
    """What `preprocess` builds when a prompt carries state besides its rows."""

    rows: np.ndarray  # [R, C] int32
    state: dict[str, np.ndarray] = field(default_factory=dict)  # name → int32 or float32 array


@dataclass
class Reference:
    """A reference clip to encode (see Reference audio)."""

    audio: np.ndarray  # [S] float32 mono in [-1, 1] at the program's reference_sample_rate
    text: str = ""  # what the clip says ("" when unknown)


@dataclass
class Voice:
    """A cloned voice as `preprocess` receives it: the encoders' features and the clip's text."""

    features: dict[str, np.ndarray]  # name → int32 or float32 array (`encode_references`)
    text: str = ""


class Attention(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (RoPE applied) → [N, Hq, D]."""
        ...


class Sampler(Protocol):
    def __call__(self, logits: torch.Tensor, salt: int) -> torch.Tensor:
        """logits [B, V] float32 → token ids [B] int64 with each request's sampling settings."""
        ...

    def untempered(self, logits: torch.Tensor, salt: int) -> torch.Tensor:
        """logits [B, K, V] → token ids [B, K] int64 drawn from each row's softmax as it is
        (temperature 1, no top-k/p or min-p, for greedy requests too), entry k with the salt
        salt + k: a redraw that ignores the request's settings (e.g. repetition-aware sampling)."""
        ...


@dataclass(frozen=True)
class CodecStreams:
    """Which codec slot each entry of a `detokenize` call continues (see Codec streams)."""

    slot: torch.Tensor  # [Bd] int64: the entry's slot, in [0, n_slots)
    fresh: torch.Tensor  # [Bd] bool: the entry starts its stream (the slot's state is reset first)


class LMProgram:
    """Base class of every model program. Subclasses set `name` and implement the hooks."""

    name: str = ""
    # LM constants (load_lm, or the spec for weight-free programs)
    n_codebooks: int = 1
    vocab_size: int = 0
    num_layers: int = 0
    num_qo_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    # codec constants
    detok_interval: int = 0  # rows per codec window
    detok_overlap: int = 0  # rows consecutive windows share
    detok_samples: int = 0  # samples each window adds
    detok_stride: int = 0  # s = detok_interval - detok_overlap: rows between consecutive windows
    detok_offset: int = 0  # window j's audio covers audio rows from j*s + detok_offset (s: stride)
    detok_lead: tuple[int, ...] = ()  # row counts a lead window may have (see Lead windows)
    detok_tail: bool = False  # detokenize takes tail windows (see Progressive first chunks)
    # `compiled_detokenize`'s function also takes the tail windows of a regular window's rows
    # (tail_rows = detok_stride: a progressive stream's newest frame after a full window of context).
    codec_compiled_tails: bool = False
    # ... and the lead windows of these sizes (rows of `detok_lead`, tail_rows 0: a request's first
    # chunk), each one more compile at startup
    codec_compiled_leads: tuple[int, ...] = ()
    codec_dtype: torch.dtype = torch.float32  # the codec's weights and activations
    # Windows per codec call (None: the codec_worker's default by device, 16 on a GPU): 1 for a codec
    # whose lone window already fills the device, so that a call of few windows is not padded.
    codec_call_batch: int | None = None
    # Windows per codec pass at most (None: the codec_worker's default, 128 on a GPU): a codec whose
    # windows are costly keeps its graphs (one call per `codec_call_batch` windows) few.
    codec_max_batch: int | None = None
    head_ids: torch.Tensor | None = None  # [V'] token id of each logits column (None: all of V)
    sample_rate: int = 24000
    # False: the model has no repetition penalty; requests' repetition_penalty is ignored, and
    # prompt ids need not be sampleable ids (input_vocab_size may exceed vocab_size).
    uses_repetition_penalty: bool = True
    # True: every GEMM of `backbone` goes through `programs.blocks.fp8.linear`, so that `fp8.rows_apart`
    # keeps a step's prompt rows and decode rows in GEMMs of their own where a GEMM's rows could
    # round by its size (bf16 weights), and a prompt may then ride in one forward pass with a decode
    # step (the gpu_worker's mixed graphs) and round as it would alone.
    mixed_prefill: bool = False
    # Request options whose value adds prompt rows (`option_rows` counts them), e.g. a context.
    sized_options: tuple[str, ...] = ()
    config_dir: str = ""  # the folder of the configs the spec names (`lm_config`, `codec_config`)
    # True: the codec decodes each request's rows once, keeping its state in codec slots (see
    # Codec streams): `init_codec_streams`, and `detokenize` takes `streams`.
    codec_streams: bool = False
    # With codec streams: each stream is conditioned on its request's voice, kept per codec slot
    # (`codec_voice`, `set_codec_voice`; see Codec streams, voiced streams).
    codec_voices: bool = False
    # With codec streams: the m > 1 for which m consecutive windows of a stream may decode as one
    # (see Codec streams, merged windows); () = each window alone.
    codec_merge: tuple[int, ...] = ()
    # A stream's first windows that yield no audio (codec streams: a decoder's look-ahead, a delay
    # pattern's lead-in): the runtime sends them at once and starts the listener's clock after them.
    detok_silent: int = 0
    # A stream's first audible windows that go out together (> 1 for programs of short windows): the
    # listener's clock starts with all of their audio in hand rather than one window's.
    detok_first_windows: int = 1
    # With codec streams: the audible windows after the first ones go out and decode in groups of
    # these sizes (the last repeats; each a size of `codec_merge` or 1), whatever the timing (see
    # Codec streams, window groups); () = none.
    detok_groups: tuple[int, ...] = ()
    # > 0: the program clones voices from reference clips at this sample rate (see Reference audio).
    reference_sample_rate: int = 0
    # True: the model speaks only in a cloned voice; a request without one is refused (model card).
    voice_required: bool = False
    # True: a request may take text appended while it runs (see Appended text), in the mode these
    # model options set (the runtime sets them on such requests).
    appends_text: bool = False
    append_options: dict[str, str] = {}
    # True: classifier-free guidance, two KV sequences per request and `guide` (see its section).
    guidance: bool = False

    def __init__(
        self,
        spec: dict[str, Any],
        *,
        load_format: str = "auto",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        weights: str | None = None,
        codec_weights: str | None = None,
        lm_head: str = "full",
        quantization: str = "none",
        codec_dtype: str = "auto",
    ) -> None:
        self.spec = spec
        self.load_format = load_format
        self.device = torch.device(device)
        self.dtype = dtype
        self.weights = weights or spec.get("hf_id")
        self.codec_weights = codec_weights or spec.get("codec_id")
        # gpu_worker options: "full" | "audio" output head (see Output heads), "none" | "fp8" weights.
        if lm_head not in ("full", "audio"):
            raise ValueError(f"lm_head must be full or audio, not {lm_head!r}")
        if quantization not in ("none", "fp8"):
            raise ValueError(f"quantization must be none or fp8, not {quantization!r}")
        self.lm_head, self.quantization = lm_head, quantization
        self._stop_ids: dict[torch.device, torch.Tensor] = {}  # classify's stop ids per device
        self.detok_interval = spec["detok_interval"]
        self.detok_overlap = spec["detok_overlap"]
        self.detok_samples = spec["detok_samples"]
        # Default: a window's audio is its newest rows (a codec that keeps the end of its window).
        self.detok_offset = spec.get("detok_offset", spec["detok_overlap"])
        self.detok_lead = tuple(spec.get("detok_lead", ()))
        self.detok_tail = bool(spec.get("detok_tail", False))
        self.sample_rate = spec["sample_rate"]
        self.n_codebooks = spec.get("n_codebooks", 1)
        self.detok_stride = self.detok_interval - self.detok_overlap
        if self.detok_stride <= 0:
            raise ValueError(f"{spec['name']}: detok_overlap must be smaller than detok_interval")
        if self.codec_streams and (self.detok_overlap or self.detok_lead or self.detok_tail):
            raise ValueError(
                f"{spec['name']}: codec streams decode each row once: detok_overlap must be 0, and "
                "there are no lead or tail windows"
            )
        bad = [m for m in self.detok_groups if m != 1 and m not in self.codec_merge]
        if self.detok_groups and (not self.codec_streams or bad):
            raise ValueError(
                f"{spec['name']}: window groups need codec streams, each size 1 or one of codec_merge"
            )
        if codec_dtype != "auto":
            if codec_dtype not in CODEC_DTYPES:
                raise ValueError(
                    f"codec_dtype must be auto or one of {', '.join(CODEC_DTYPES)}, not {codec_dtype!r}"
                )
            self.codec_dtype = getattr(torch, codec_dtype)

    @property
    def rows_per_second(self) -> float:
        """Rows generated per second of audio (`programs.rows_per_second` of the spec)."""
        return programs.rows_per_second(self.spec)

    @property
    def input_vocab_size(self) -> int:
        """Prompt row ids must lie in [0, input_vocab_size)."""
        return self.vocab_size

    # --- loading -------------------------------------------------------------------------------
    def load_lm(self) -> None:
        raise NotImplementedError

    def load_codec(self) -> None:
        raise NotImplementedError

    def set_decoder_shapes(self, cfg: dict[str, Any]) -> None:
        """The LM constants of a Hugging Face-style decoder config: `num_layers`, `num_qo_heads`,
        `num_kv_heads`, `hidden_size`, `head_dim` (the config's, else hidden / heads)."""
        self.num_layers = cfg["num_hidden_layers"]
        self.num_qo_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg["num_key_value_heads"]
        self.hidden_size = cfg["hidden_size"]
        self.head_dim = cfg.get("head_dim") or self.hidden_size // self.num_qo_heads

    def config_path(self, key: str) -> str:
        """The shipped config file the spec names under `key`, in the program's `config_dir`."""
        return os.path.join(self.config_dir, self.spec[key])

    def read_config(self, key: str) -> dict[str, Any]:
        with open(self.config_path(key)) as f:
            return json.load(f)

    def lm_weights(self, cls: type[T]) -> T:
        """The LM class `cls` with random weights of the spec's `lm_config` (`--load-format dummy`, or
        no checkpoint), else from the checkpoint (`cls.dummy` / `cls.from_pretrained`)."""
        if self.load_format == "dummy" or self.weights is None:
            return cls.dummy(self.read_config("lm_config"), self.dtype, self.device)
        return cls.from_pretrained(self.weights, self.dtype, self.device)

    def codec_model(self, cls: type[T]) -> T:
        """The codec class `cls` with random weights of the spec's `codec_config`, else from the codec
        checkpoint (`cls.from_config` / `cls.from_pretrained`), in `codec_dtype`."""
        if self.load_format == "dummy" or self.codec_weights is None:
            return cls.from_config(self.config_path("codec_config"), self.codec_dtype, self.device)
        return cls.from_pretrained(self.codec_weights, self.codec_dtype, self.device)

    def load_prompts(self) -> None:
        """The text tokenizer `preprocess` uses (programs.blocks.text_tokenizer)."""
        from programs.blocks.text_tokenizer import load_text_tokenizer

        self._tokenizer = load_text_tokenizer(self.spec, self.weights, self.load_format)

    # --- LM step (graph) -----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        raise NotImplementedError

    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode_tokens(
        self, hidden: torch.Tensor, c0: torch.Tensor, sample: Sampler, rows: Rows
    ) -> torch.Tensor:
        """hidden [B, H] (backbone, last row of each request), c0 [B] int64 sampled codebook 0 →
        the full row [B, C] int64. Needed when n_codebooks > 1."""
        raise NotImplementedError(f"{self.name} has {self.n_codebooks} codebooks and no decode_tokens")

    def compile_depth(self, enabled: bool = True) -> bool:
        """Put the compilable pieces of `decode_tokens` under torch.compile (--depth-compile), or
        (enabled False) take them off again; False when the program has none, and the runtime then
        compiles the whole depth step."""
        return False

    def fuse_layers(self) -> bool:
        """Switch the loaded LM's layers to fused GPU kernels (--fused-step on), where the program
        has them and the device takes them; → whether it did. The same math in another rounding
        order, with every kernel row-wise, so a row's bits still do not depend on its batch."""
        return False

    def guide(self, logits: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """logits [B, 2, C', V] float32 of each request's conditional and unconditional sequence,
        slot [B] → the logits it samples from [B, C', V]. Needed when `guidance` is set."""
        raise NotImplementedError(f"{self.name} sets guidance and has no guide")

    # --- per-request state (gpu_worker, host) --------------------------------------------------
    def init_state(self, num_slots: int) -> None:
        """Allocate per-request state buffers [num_slots, …] on self.device (none by default)."""

    def check_prompt(self, rows: np.ndarray, state: dict[str, np.ndarray]) -> str:
        """Why a prompt's rows [R, C] (ids in [0, input_vocab_size) already) or state arrays are not
        what `preprocess` builds ("" when they are)."""
        return f"{self.name} prompts carry no state; got {sorted(state)}" if state else ""

    def admit(self, slot: int, state: dict[str, np.ndarray]) -> None:
        """Write a request's state (vetted by `check_prompt`) into `slot` as it starts."""

    def codec_prefix(self, state: dict[str, np.ndarray]) -> np.ndarray | None:
        """Rows [P, C] int32 that a request's codec stream decodes before its audio rows, their
        audio dropped (see Codec streams: primed streams), from its state; None: none (default)."""
        return None

    def codec_voice(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """With `codec_voices`: the arrays a request's codec stream is conditioned on, from its state
        (see Codec streams: voiced streams); None: the codec's default voice (the default)."""
        return None

    @property
    def can_constrain(self) -> bool:
        """Whether this program has a constrained sampling mode (it overrides `candidates`; its spec
        says so with `"constrainable": True`, which the gateway checks `--constrained` against)."""
        return type(self).candidates is not LMProgram.candidates

    def candidates(self, n_audio: torch.Tensor) -> torch.Tensor:
        """Token ids a constrained request may sample next, given its audio rows so far."""
        raise NotImplementedError(f"{self.name} has no constrained sampling mode")

    # --- appended text (see Appended text) -----------------------------------------------------
    @property
    def append_capacity(self) -> int:
        """Appendable rows one request holds (0: the program takes no appended text)."""
        return 0

    def take_text(self, text: str, final: bool) -> tuple[str, str]:
        """(the part of `text` whose tokens are final, the rest held back until more text follows);
        `final`: nothing follows, nothing is held back."""
        raise NotImplementedError(f"{self.name} takes no appended text")

    def append(self, text: str) -> dict[str, np.ndarray]:
        """Taken text → state rows, name → [k, …] int32/float32 array (k = `appended_rows`)."""
        raise NotImplementedError(f"{self.name} takes no appended text")

    def appended_rows(self, state: dict[str, np.ndarray]) -> int:
        """Appendable rows a prompt's or an append's state holds."""
        return 0

    def check_append(self, state: dict[str, np.ndarray]) -> str:
        """Why an append's state is not what `append` builds ("" when it is)."""
        return f"{self.name} takes no appended text"

    def extend(self, slot: int, state: dict[str, np.ndarray], start: int) -> None:
        """Write an append's rows into `slot` at rows [start, start + k) (host side, between steps)."""
        raise NotImplementedError(f"{self.name} takes no appended text")

    def open_steps(self, n_rows: int) -> int:
        """Steps (the prompt's included) a request holding `n_rows` appended rows may launch while
        its input is open."""
        return 0

    # --- tokens → meaning (host) ---------------------------------------------------------------
    def stop_tokens(self) -> list[int]:
        return list(self.spec["stop_tokens"])

    def classify(self, tokens: torch.Tensor, n_audio: torch.Tensor) -> torch.Tensor:
        """What each sampled row means, given the request's audio rows so far; runs on the device
        right after sampling. Default: codebook-0 stop tokens stop, `audio_tokens` are audio."""
        t0 = tokens[:, 0]
        lo, hi = self.spec["audio_tokens"]
        kinds = torch.where((t0 >= lo) & (t0 < hi), int(TokenKind.AUDIO), int(TokenKind.OTHER))
        # The ids on the device once: a copy from the host each call would wait for the stream, and
        # cannot be captured in a sampling graph (the gpu_worker's sampling graphs).
        ids = self._stop_ids.get(t0.device)
        if ids is None:
            ids = self._stop_ids[t0.device] = torch.tensor(self.stop_tokens(), device=t0.device)
        return torch.where(torch.isin(t0, ids), int(TokenKind.STOP), kinds)

    # --- codec (graph) -------------------------------------------------------------------------
    def detokenize(
        self,
        tokens: torch.Tensor,
        keys: torch.Tensor,
        tail_rows: int = 0,
        streams: CodecStreams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def init_codec_streams(self, n_slots: int) -> None:
        """Allocate the state of `n_slots` codec slots on the codec's device (codec_streams only;
        see Codec streams). Called once, after `load_codec`."""
        raise NotImplementedError(f"{self.name or type(self).__name__} has no codec streams")

    def prime_codec_streams(self, tokens: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Start the streams in `slots` [B] int64 with the rows tokens [B, P, C] (keys [B] int64) from
        the codec's initial state, their audio dropped (see Codec streams: primed streams). Eager,
        outside the graphs. Default: one `detokenize` call of them, fresh."""
        fresh = torch.ones(len(slots), dtype=torch.bool, device=slots.device)
        self.detokenize(tokens, keys, streams=CodecStreams(slots, fresh))

    def set_codec_voice(self, slot: int, voice: dict[str, torch.Tensor] | None) -> None:
        """With `codec_voices`: condition codec slot `slot`'s stream on `voice` (`codec_voice`'s
        arrays as tensors on the codec's device; None: the default voice). Eager, host side, before
        the slot's first window (see Codec streams: voiced streams)."""
        if voice:
            raise ValueError(f"{self.name} streams take no voice; got {sorted(voice)}")

    def compiled_detokenize(
        self, backend: str = "inductor"
    ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        """`detokenize(tokens, keys)` of regular windows under torch.compile (`backend`), or None
        when this program has no compiled codec."""
        return None

    # --- reference audio (codec_worker) --------------------------------------------------------
    def load_encoders(self) -> None:
        """Load the reference-audio encoders (reference_sample_rate > 0 only)."""
        raise NotImplementedError(f"{self.name or type(self).__name__} takes no reference audio")

    def encode_references(self, clips: list[Reference]) -> list[dict[str, np.ndarray]]:
        """Each clip's features (name → int32/float32 array), computed as one batch."""
        raise NotImplementedError(f"{self.name or type(self).__name__} takes no reference audio")

    # --- prompts (tokenizer_worker) ------------------------------------------------------------
    def preprocess(
        self, text: str, model_kwargs: dict[str, str], voice: Voice | None = None
    ) -> np.ndarray | PromptRows:
        raise NotImplementedError

    def prompt_overhead(self) -> int:
        """Prompt rows besides the text's tokens, with no model options: a prompt of a text of b
        UTF-8 bytes has at most prompt_overhead() + b rows (byte-level tokenizers). Default: the
        spec's `prefix_ids` and `suffix_ids`, BOS, and the `text_template` around the text for the
        longest voice, its characters counted as bytes."""
        voices = self.spec.get("voices") or [""]
        template = str(self.spec.get("text_template", "{text}"))
        around = max(len(template.format(voice=v, text="").encode()) for v in voices)
        return len(self.spec.get("prefix_ids", ())) + len(self.spec.get("suffix_ids", ())) + 1 + around

    def option_rows(self, model_kwargs: dict[str, str], voice: Voice | None = None) -> int:
        """Prompt rows the request's model options add beyond `prompt_overhead()`, for the options
        named in `sized_options` (a conversation context) and a cloned `voice` (its reference
        rows); 0 by default. ValueError → HTTP 400. The runtime asks whenever a request sets a
        sized option or carries a voice, so that a long text is cut for the budget they leave."""
        return 0

    def model_spec(self, served: str) -> ModelSpec:
        """Every fact the gateway needs about this model, served as `served` (the --model name);
        the tokenizer_worker announces it (common.messages.ModelSpec)."""
        spec = self.spec
        defaults = {
            k: v for k, v in spec.get("sampling", {}).items() if k in SamplingParams.__struct_fields__
        }
        voices = [str(v) for v in spec.get("voices", ())]
        return ModelSpec(
            name=served,
            aliases=[n for n in programs.aliases_of(served) if n != served.lower()],
            voices=voices,
            default_voice=str(spec.get("default_voice", voices[0] if voices else "")),
            sample_rate=int(self.sample_rate),
            rows_per_second=self.rows_per_second,
            max_tokens=int(spec["max_tokens"]),
            vocab_size=int(self.vocab_size),
            prompt_overhead=self.prompt_overhead(),
            window_rows=int(self.detok_interval),
            sampling=SamplingParams(**defaults),
            constrained=bool(spec.get("constrained", False)),
            constrainable=bool(spec.get("constrainable", False)),
            options=dict(spec.get("model_options", {})),
            refused=dict(spec.get("refused", {})),
            n_codebooks=int(self.n_codebooks),
            sized_options=list(self.sized_options),
            languages=[str(x) for x in spec.get("languages", ())],
            reference_sample_rate=int(self.reference_sample_rate),
            voice_required=bool(self.voice_required),
            append_rows=int(self.append_capacity) if self.appends_text else 0,
            append_options=dict(self.append_options) if self.appends_text else {},
        )


def pcm16(audio: torch.Tensor) -> torch.Tensor:
    """Float audio → int16 the way the reference converts it (scale by 32767, truncate toward
    zero), clamping first so out-of-range samples saturate instead of wrapping."""
    return (audio.float().clamp(-1.0, 1.0) * 32767.0).to(torch.int16)
