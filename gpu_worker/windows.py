"""Which codec windows a request's audio rows make, and when (programs/base.py: "Audio chunks",
"Lead windows").

Regular window j holds audio rows [j*s, j*s + detok_interval) (s = detok_interval - detok_overlap)
and goes out when its last row exists. Before it, a request may send one *lead window* of R rows
(a `detok_lead` size) when the engine's step rate (its pessimistic estimate,
`StepClock.rows_time_high`) says the next regular window will arrive before the lead has played
out, and at the largest lead size in any case (a lead carries the audio before the first regular
window's, so a request's audio does not depend on the step rate); the regular windows whose audio
the lead covers are then skipped.

Progressive mode (`--first-chunk progressive`, programs with `detok_tail`): the first chunk goes
out after one frame when, at that step rate, the next frame will reach the listener before that
one has played out (`DELIVERY_S` allowed for the trip, `LANE_DELIVERY_S` where the codec's first
lane decodes second chunks at once), else after as many frames as that takes (a
lead window, up to the largest `detok_lead`). Each new frame then goes out at once as a tail window
(the frame decoded after up to detok_interval - s rows of context, nothing after it), until the
audio sent and not yet played covers the wait for the next regular window, its steps taken at the
step budget or the pessimistic pace, whichever is slower (`switches`); from then on, regular windows
only. So the first audio comes after one frame at light load, only the frames sent before the
switch differ from the reference, and a stream that has switched spares the next step its whole
budget while the steps keep the pace it switched on: the admission may fill a step up to the budget
beside streams that just switched (`step_allowances`, `pacing.withheld`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from common.arrays import wire_array
from common.config import CodecSettings
from common.messages import LEAD_NOISE_BASE, Array, DetokChunk
from gpu_worker.scheduler.pacing import LEAD_MARGIN, StepClock, lead_fits, step_allowances, switch_fits
from programs.base import LMProgram

FIRST_CHUNK_MODES = ("reference", "adaptive", "fastest", "progressive")
# Progressive mode: what a chunk's trip takes besides the steps that make it (waiting for a codec
# pass, the decode, the gateway, the network). On the H200 at 128 streams, with a frame's worth of
# steps as the only allowance, the second frame comes ~6 ms late for 1 stream in 5.
DELIVERY_S = 0.025
# ... for the second chunk, where the codec's first lane decodes it beside a pass rather than after
# it (`--codec-first-lane`, codec_worker/codec.py FirstLane): at Poisson 80 req/s on an H100 first
# chunks in the lane took 3.7 / 8.8 ms (p50 / p90) from ready to decoded. Near capacity, where
# passes are long and the load grows under a first chunk just sent, it is too little: 7 of 1,180
# requests late there (the first lane's second-chunk record in bench/results), none at 60 req/s.
LANE_DELIVERY_S = 0.015
# ... and only while the streams running are at most this share of the capacity the worker reports
# (`--codec-first-lane-room`): nearer it, the codec's passes are long and a growing load slows the
# steps after the decision, and the trip is allowed DELIVERY_S (the 7 late requests above were sent
# at 0.53-0.62 of it).
LANE_ROOM = CodecSettings().first_lane_room


def second_trip_s(load: float, lane_room: float, second_delivery_s: float) -> float:
    """What a first chunk sent at `load` (the streams over the capacity reported) allows for the
    second chunk's trip: `second_delivery_s` within `lane_room` of the capacity, else no less than
    DELIVERY_S."""
    return second_delivery_s if load <= lane_room else max(second_delivery_s, DELIVERY_S)


def clock_window(program: LMProgram) -> int:
    """The window whose leaving starts the listener's clock: the last of the first audible ones."""
    return program.detok_silent + program.detok_first_windows - 1


def window_group(program: LMProgram, index: int) -> tuple[int, int]:
    """(its first window's index, its size) of the window group (the program's `detok_groups`)
    holding window `index` past the clock window: the sizes in turn from the clock window on, the
    last repeating."""
    sizes, first = program.detok_groups, clock_window(program) + 1
    for m in sizes[:-1]:
        if index < first + m:
            return first, m
        first += m
    m = sizes[-1]
    return first + (index - first) // m * m, m


def group_pace(program: LMProgram, horizon: int = 64) -> float:
    """How many times faster than real time the LM must run for window groups to reach the
    listener in time (1.0 without groups): window i leaves when its group's last window L(i)
    exists, L(i) - c windows of rows after the clock window c left, and must arrive by the time
    the i - detok_silent windows before it have played, so the LM needs
    (L(i) - c) / (i - detok_silent) times real time; the largest over the first windows."""
    if not program.detok_groups:
        return 1.0
    c, silent = clock_window(program), program.detok_silent
    pace = 1.0
    for i in range(c + 1, c + 1 + horizon):
        first, m = window_group(program, i)
        pace = max(pace, (first + m - 1 - c) / (i - silent))
    return pace


class AudioWindows:
    def __init__(
        self,
        program: LMProgram,
        first_chunk: str,
        clock: StepClock,
        now: Callable[[], float] = time.monotonic,
        first_margin: float = LEAD_MARGIN,
        second_delivery_s: float = DELIVERY_S,
        lane_room: float = LANE_ROOM,
    ) -> None:
        """`second_delivery_s`: what the first-chunk decision allows for the second chunk's trip
        (DELIVERY_S; LANE_DELIVERY_S where the codec's first lane decodes second chunks), while the
        streams are at most `lane_room` of the capacity (`second_trip_s`)."""
        if first_chunk not in FIRST_CHUNK_MODES:
            raise ValueError(
                f"first_chunk must be one of {', '.join(FIRST_CHUNK_MODES)}, not {first_chunk!r}"
            )
        if first_chunk == "progressive" and not program.detok_tail:
            raise ValueError(
                f"{program.name} has no tail windows: --first-chunk progressive is not available"
            )
        held = program.detok_first_windows
        if held < 1:
            raise ValueError(f"{program.name}: detok_first_windows is at least 1, not {held}")
        if program.detok_groups and program.appends_text:
            # A request waiting for appended text would hold its group's finished windows unsent.
            raise ValueError(f"{program.name} sends windows in groups: not with appended text")
        if held > 1 and (first_chunk == "progressive" or program.appends_text):
            # Progressive tail windows go out one frame at a time, and a request waiting for appended
            # text would sit out with its first windows held: neither holds first windows back.
            raise ValueError(
                f"{program.name} holds its first {held} audible windows: not with "
                + ("--first-chunk progressive" if first_chunk == "progressive" else "appended text")
            )
        self.program = program
        self.clock_window = clock_window(program)
        self.stride = program.detok_stride
        self.fastest = first_chunk == "fastest"
        self.progressive = first_chunk == "progressive"
        self.leads = () if first_chunk in ("reference", "progressive") else tuple(program.detok_lead)
        self.clock = clock
        self.now = now
        self.first_margin = first_margin  # the first chunk's decision (`_first_now`, `lead_now`)
        self.second_delivery_s = second_delivery_s  # ... and its allowance for the second's trip
        # the streams running over the capacity the worker reports (the engine's scheduler sets it):
        # past `lane_room` the second chunk's trip is allowed DELIVERY_S whatever `second_delivery_s`
        self.load: Callable[[], float] = lambda: 0.0
        self.lane_room = lane_room
        # The switch to regular windows (`switches`) at no less margin than `step_allowances` takes
        self.switch_margin = max(LEAD_MARGIN, first_margin)
        # The rows n (mod stride) at which after_row may make a window (it returns None at any other):
        # the end of a regular window, of a lead, of a frame in progressive mode. The engine calls
        # it at those rows only.
        s = self.stride
        self.due = frozenset(
            {program.detok_interval % s, *(n % s for n in self.leads)} | ({0} if self.progressive else set())
        )

    def after_row(self, req, out: list[DetokChunk]) -> None:
        """The window that `req`'s newest audio row (row n - 1 of req.audio) completes, if any, into
        `out` (with the windows held before it: `_send`). Advances req.n_chunks and, after a lead,
        req.first_window."""
        n, interval = req.n_audio, self.program.detok_interval
        if self.progressive and not req.switched:
            if n % self.stride or (req.n_chunks == 0 and not self._first_now(n)):
                return
            out.append(self._tail(req))
            return
        if n >= interval and (n - interval) % self.stride == 0:
            j = (n - interval) // self.stride
            if j < req.first_window:
                return  # covered by the lead window
            chunk = DetokChunk(req.rid, req.n_chunks, req.sp.seed, req.audio[n - interval : n].tobytes(), j)
            audio_rows = self.stride
        elif req.n_chunks == 0 and n in self.leads and (n == max(self.leads) or self.lead_now(n)):
            chunk = DetokChunk(req.rid, 0, req.sp.seed, req.audio[:n].tobytes(), LEAD_NOISE_BASE + n)
            req.first_window = self.first_window_after(n)
            audio_rows = n
        else:
            return
        self._send(req, chunk, audio_rows, out)

    def _send(self, req, chunk: DetokChunk, audio_rows: int, out: list[DetokChunk]) -> None:
        """Count `chunk` as sent (`_sent`) and put it in `out`, except a stream's first audible
        windows but the last of the program's `detok_first_windows`: they wait in req.held and go
        with it, so that one codec pass decodes them and the listener starts with all of their
        audio. With window groups, a later window waits in req.grouped until its group's last
        window exists, and counts as sent (its slack, the listener's audio in hand) only when the
        group leaves."""
        if self.program.detok_groups and chunk.index > self.clock_window:
            first, m = self.group(chunk.index)
            chunk.group = first
            req.n_chunks += 1
            req.grouped.append((chunk, audio_rows))
            if chunk.index == first + m - 1:
                self._release(req, out)
            return
        self._sent(req, chunk, audio_rows)
        if self.program.detok_silent <= chunk.index < self.clock_window:
            req.held.append(chunk)
            return
        if req.held:
            out.extend(req.held)
            req.held.clear()
        out.append(chunk)

    def group(self, index: int) -> tuple[int, int]:
        """(its first chunk's index, its size) of the window group holding chunk `index`."""
        return window_group(self.program, index)

    def rows_to_group_end(self, req) -> int:
        """Audio rows `req` still needs before its next window group (the one it fills now, or the
        one its next window opens) leaves: 0 without groups or before the clock window."""
        if not self.program.detok_groups or req.n_chunks <= self.clock_window:
            return 0
        first, m = self.group(req.grouped[0][0].index if req.grouped else req.n_chunks)
        return max(0, (first + m) * self.program.detok_interval - req.n_audio)

    def rows_to_next_send(self, req) -> int:
        """Audio rows `req` still needs before its next chunk leaves (its newest row's step
        included): the next frame while it sends tail windows, else its next regular window, or the
        end of the window group that window falls in."""
        n, s = req.n_audio, self.stride
        if self.progressive and not req.switched:
            return s - n % s
        interval = self.program.detok_interval
        j = max(req.first_window, -(-(n + 1 - interval) // s))  # the first window ending past row n
        return max(1, j * s + interval - n, self.rows_to_group_end(req))

    def one_frame_row_s(self) -> float:
        """Progressive mode: the pessimistic seconds per row up to which a first chunk sent now goes
        out after one frame (`_first_now`: the next frame's steps, with the first chunk's margin,
        and `second_trip_s()` for the second chunk's trip, within the frame's audio)."""
        return (self._audio_s(self.stride) - self.second_trip_s()) / (self.stride * self.first_margin)

    def second_trip_s(self) -> float:
        """What a first chunk sent now allows for the second chunk's trip (`second_trip_s`)."""
        return second_trip_s(self.load(), self.lane_room, self.second_delivery_s)

    def spare(self, req, now: float) -> tuple[float, int]:
        """(seconds of audio its listener has in hand, audio rows until its first chunk that waits for
        the next step launched) of a playing stream. Rows launched before that step (`n_launched`
        past `n_gen`: the step in flight) may complete its next chunk without it: then the chunk
        after is the one that waits, and the audio of the one before counts as in hand (not with
        window groups, whose next group's audio and rows are taken at the least and the most)."""
        in_hand, rows = req.sent_s - (now - req.t_first), self.rows_to_next_send(req)
        flight, groups, s = max(0, req.n_launched - req.n_gen), self.program.detok_groups, self.stride
        tails = self.progressive and not req.switched
        while rows <= flight:
            if groups:
                rows += max(groups) * s
            elif tails:
                in_hand += self._audio_s(s)
                # That tail window switches the stream to regular windows where the audio in hand
                # when it leaves covers the wait for the next one (`switches`), taken as what is in
                # hand now less the rows before it at the pessimistic pace: a switch foreseen so
                # leaves the next step its budget, and one not foreseen still covers that step.
                wait = self._rows_to_next_window(req.n_audio + rows)
                left = in_hand - self.switch_margin * self.clock.rows_time_high(rows)
                tails = not self.switches(wait, left)
                rows += s if tails else max(s, wait)
            else:
                in_hand += self._audio_s(s)
                rows += s
        return in_hand, rows

    def step_allowances(self, streams) -> tuple[float, float]:
        """The longest the next step may take with every playing stream among `streams` ((request,
        steps it may wait besides: one for a stream whose text has run out, which resumes a step
        after its text comes)) still getting its next chunk in time (`pacing.step_allowance` on
        `spare`, at the first chunk's margin and `DELIVERY_S`), inf where none plays: with its other
        rows at least a step budget each (what a step may borrow past its budget on: a clock that
        has measured little may not know the pace), and at the clock's pessimistic pace alone (the
        pace its first chunk was promised on: what a step may take of its budget)."""
        now, clock = self.now(), self.clock
        playing = []
        for r, later in streams:
            if r.n_chunks > self.clock_window:
                in_hand, rows = self.spare(r, now)
                playing.append((in_hand, rows + later))
        return step_allowances(playing, clock.rows_time_high, self.first_margin, DELIVERY_S, clock.budget)

    def _release(self, req, out: list[DetokChunk]) -> None:
        """`req`'s grouped windows into `out`, each counted as sent now, in order."""
        now = self.now()
        for chunk, rows in req.grouped:
            self._stamp(req, chunk, rows, now)
            out.append(chunk)
        req.grouped.clear()

    def _stamp(self, req, chunk: DetokChunk, audio_rows: int, now: float) -> None:
        """A window after the clock window leaving: its listener's slack, then its audio in hand."""
        chunk.slack_ms = max(0.0, 1000 * (req.sent_s - (now - req.t_first)))
        req.sent_s += self._audio_s(audio_rows)

    def _sent(self, req, chunk: DetokChunk, audio_rows: int) -> DetokChunk:
        """Count `chunk` (of `audio_rows` rows of audio) as sent, stamped with its listener's slack.
        A stream's first `detok_silent` windows yield no audio and count nothing; the listener's
        clock starts at the window after them. Each may wait (be gathered with others) until about
        when the first window with audio comes, its rows still to be generated: decoding them alone
        as they come would cost a codec call per stream per step, and leaving them all to the first
        audible window would queue them before it (a stream's windows decode in order). The clock
        starts when the last of the first `detok_first_windows` audible windows leaves (the ones
        before it leave with it, each with no slack)."""
        now = self.now()
        if req.n_chunks == 0:
            chunk.prefix = self._prefix(req)  # what the stream's fresh codec slot starts from
            chunk.voice = self._voice(req)  # and the voice it is conditioned on
        silent = self.program.detok_silent
        if req.n_chunks < silent:
            rows_left = silent - req.n_chunks
            chunk.slack_ms = 1000 * rows_left * self.clock.row_period()  # 0 before a step is measured
            req.n_chunks += 1
            return chunk
        if req.n_chunks > self.clock_window:
            self._stamp(req, chunk, audio_rows, now)
        else:
            if req.n_chunks == self.clock_window:
                req.t_first = now
            req.sent_s += self._audio_s(audio_rows)
        req.n_chunks += 1
        return chunk

    def _prefix(self, req) -> bytes:
        """The rows `req`'s codec stream starts with (the program's `codec_prefix`), as wire bytes."""
        rows = self.program.codec_prefix(req.state)
        return b"" if rows is None else np.ascontiguousarray(rows, dtype="<i4").tobytes()

    def _voice(self, req) -> dict[str, Array]:
        """The arrays `req`'s codec stream is conditioned on (the program's `codec_voice`), as wire
        arrays; empty for the codec's default voice."""
        voice = self.program.codec_voice(req.state) if self.program.codec_voices else None
        return {name: wire_array(a) for name, a in (voice or {}).items()}

    def _first_now(self, n: int) -> bool:
        """Progressive mode: may the first chunk go out with the n rows there are? Yes when the
        next frame, s rows later, will reach the listener before these have played out (else one
        more frame first; its trip `second_trip_s()`), and always at the largest lead size."""
        leads = self.program.detok_lead
        if not leads or n >= max(leads):
            return True
        period = self._period_high(self.stride)
        return lead_fits(
            self.stride, self._audio_s(n), period, self.first_margin, latency_s=self.second_trip_s()
        )

    def _tail(self, req, n: int = -1) -> DetokChunk:
        """The newest frame as a tail window (a first chunk: every frame so far, decoded whole as a
        lead window); then switch to regular windows for good if the audio sent so far outlasts the
        wait for the next regular one (req.switched)."""
        p, s = self.program, self.stride
        n = req.n_audio if n < 0 else n  # audio rows up to the newest frame
        lo = max(0, n - p.detok_interval)
        # Same noise as the window of these rows decoded any other way: a lead window from row 0,
        # else the regular window of rows [lo, n).
        noise = LEAD_NOISE_BASE + n if lo == 0 else lo // s
        rows = n if req.n_chunks == 0 else s  # rows of audio this chunk carries
        chunk = DetokChunk(
            req.rid, req.n_chunks, req.sp.seed, req.audio[lo:n].tobytes(), noise, tail_rows=rows
        )
        self._sent(req, chunk, rows)
        # The audio sent and not yet played (by the clock: the listener started no earlier than
        # the first chunk left) must outlast the wait for the next regular window.
        ahead_s = req.sent_s - (self.now() - req.t_first)
        if self.switches(self._rows_to_next_window(n), ahead_s):
            req.first_window, req.switched = self.first_window_after(n), True
        return chunk

    def switches(self, wait_rows: int, ahead_s: float) -> bool:
        """Progressive mode: does a stream with `ahead_s` seconds of audio sent and not yet played
        switch to regular windows, the next `wait_rows` rows away? When that audio outlasts their
        steps (with the trip, and `switch_margin`: `lead_fits`' margin, or the allowances' if
        higher) at the pessimistic pace or at the step budget, whichever is slower (never while the
        clock has measured and expects nothing). A switched stream's next audio is that far off, and
        a step the admission fills up to the budget must not make it late: switched at the pace
        alone, it would spare the next step about the pace and no more (`pacing.withheld`). Until
        then its frames go out as tail windows, one codec window a frame, as regular ones."""
        pace = self._period_high(wait_rows)  # 0: nothing measured or expected
        return switch_fits(wait_rows, ahead_s, pace, self.clock.budget, self.switch_margin, DELIVERY_S)

    def flush(self, req, out: list[DetokChunk]) -> None:
        """At a request's natural end: into `out`, the windows it still holds (in progressive mode,
        the first chunk if it was still waiting for more frames; the first audible windows held
        for more; the windows of its last window group)."""
        if self.progressive and req.n_chunks == 0 and req.n_audio >= self.stride:
            # A stream that ended while its first chunk waited for a second frame: send what it has.
            out.append(self._tail(req, req.n_audio - req.n_audio % self.stride))
        out.extend(req.held)
        req.held.clear()
        self._release(req, out)  # the last group's windows that exist

    def first_window_after(self, lead_rows: int) -> int:
        """The first regular window whose audio starts at or after the lead's: window j covers
        audio rows from j*s + detok_offset."""
        return max(0, -(-(lead_rows - self.program.detok_offset) // self.stride))

    def lead_now(self, lead_rows: int) -> bool:
        """Send a lead window of `lead_rows` now? Only when the next regular window will arrive
        before the lead's audio has played out, at the rate steps go now. (At the largest lead size
        the lead always goes: it is what carries the audio before the first regular window's, so
        every request's audio is the same whatever the step rate was.)"""
        if self.fastest:
            return True
        gap = self._rows_to_next_window(lead_rows)
        return lead_fits(gap, self._audio_s(lead_rows), self._period_high(gap), self.first_margin)

    def _period_high(self, rows: int) -> float:
        """A pessimistic seconds per row over the next `rows` steps."""
        return self.clock.rows_time_high(rows) / max(rows, 1)

    def _rows_to_next_window(self, n: int) -> int:
        """Rows from audio row n until the regular window carrying the audio after row n exists."""
        return self.first_window_after(n) * self.stride + self.program.detok_interval - n

    def _audio_s(self, rows: int) -> float:
        """Seconds of audio that `rows` audio rows decode to."""
        return rows * self.program.detok_samples / self.stride / self.program.sample_rate
