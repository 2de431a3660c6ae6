"""What the scheduler keeps per request (gpu_worker/scheduler/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.messages import SamplingParams


@dataclass
class Request:
    rid: str
    prompt: np.ndarray  # [R, C] int64
    sp: SamplingParams
    arrival: float
    budget: int  # total tokens allowed, prompt included
    urgent: bool = False  # a later segment of a stream already playing: admitted before new ones
    state: dict[str, np.ndarray] = field(default_factory=dict)  # the program's, for its slot
    # [R, C] int64 the unconditional prompt of a guided program (its second KV sequence), else None
    unguided: np.ndarray | None = None
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # sampling-state slot while running
    n_ctx: int = 0  # rows in the KV cache once the launched steps complete
    n_launched: int = 0  # sampling steps launched
    n_gen: int = 0  # sampled rows consumed
    done: bool = False  # finished (its results from steps still in flight are dropped)
    # rows consumed (stop excluded): the codebook-0 id when C = 1, else the whole row as a list
    generated: list = field(default_factory=list)
    audio: np.ndarray | None = None  # [budget, C] int32 audio rows
    n_audio: int = 0
    n_chunks: int = 0
    first_window: int = 0  # regular windows below this are covered by the lead or tail windows sent
    switched: bool = False  # progressive mode: tail windows are over, regular ones from now on
    t_first: float = 0.0  # monotonic time its first chunk left (its listener's playback starts)
    sent_s: float = 0.0  # seconds of audio in the chunks sent so far
    # its first audible windows, held until the last of them (the program's `detok_first_windows`)
    held: list = field(default_factory=list)
    # (chunk, audio rows) of its window group still waiting for the group's last window (the
    # program's `detok_groups`), not yet counted as sent
    grouped: list = field(default_factory=list)
    admitted_at: float = 0.0
    gen_budget: int = 0  # rows it may generate: budget less the prompt
    # its first step runs in a prompt lane (gpu_worker/runner/prompt_lane.py): out of the steps
    lane: bool = False
    # the slot and KV pages it gave back when it ended (a step launched before may still write them)
    released: tuple[int, list[int]] | None = None
    input_open: bool = False  # more text may be appended (gpu_worker/appends.py)
    n_text: int = 0  # appendable rows its state holds (the program's `appended_rows`)

    def __post_init__(self) -> None:
        self.gen_budget = self.budget - len(self.prompt)
