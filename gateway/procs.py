"""The gateway's view of the other processes, built from their `ProcStatus` heartbeats; it answers
`GET /ready`.

Every process sends a `ProcStatus` on each state change and every 0.25 s. Ages are measured on the
gateway's own monotonic clock at receipt, not from the sender's `time`, so clock skew between hosts
cannot make a live process look dead (or a dead one alive).

Dead or slow: a heartbeat late by more than `stale_after_s` makes a process "unresponsive" in
/ready, but costs none of its requests: a stall under heavy CPU load, a long garbage collection or a
SIGSTOP ends, and its streams go on. A process on this host and PID namespace (its status's `host`
is the gateway's) is dead the moment its pid is gone (exited, killed, or a zombie not yet reaped):
its requests fail at once. One whose pid the gateway cannot see (another host or container) is
dead after `heartbeat_timeout_s` without a heartbeat, and so is a local one that stays silent that
long (hung). A status saying FAILED, or another instance under a known name (another pid or PID
namespace), ends the old one at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
from typing import Any

from common.messages import ProcState, ProcStatus
from common.proc import HOST_ID, process_start

# Four missed heartbeats (0.25 s apart) and a process counts as not ready (but not dead).
STALE_AFTER_S = 1.0
# A process silent this long is dead even where its pid seems alive (`--heartbeat-timeout`).
HEARTBEAT_TIMEOUT_S = 10.0
# A dead process's row leaves /ready after this long without a word (or 6 heartbeat timeouts).
FORGET_AFTER_S = 120.0

# What a status may claim. Peers are authenticated (ipc:// in a private directory, CURVE on tcp://),
# but a status is still bounded, so one bad claim cannot take the gateway's numbers with it:
ROLES = ("tokenizer_worker", "gpu_worker", "codec_worker")
MAX_SLOTS = 65_536  # capacity and load: above any gpu_worker's batch
MAX_PROCESSES = 1_024  # rows in the table
MAX_METRICS = 64
MAX_METRIC = 1e15
MAX_DETAIL = 500  # characters of `detail` kept
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_METRIC_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")

log = logging.getLogger(__name__)


REMOTE = "remote"  # the start mark of a process whose pid the gateway cannot see


@dataclasses.dataclass
class _Entry:
    status: ProcStatus
    received: float  # time.monotonic() at receipt
    # On this host: the process's start mark (`process_start`) when first heard from, None if it
    # was already gone; elsewhere (its pid means nothing here) `REMOTE`.
    start: str | None

    def exited(self) -> bool:
        """Its pid is gone or belongs to another process now (only known on this host)."""
        return self.start != REMOTE and (self.start is None or process_start(self.status.pid) != self.start)


class ProcessTable:
    """Last status of every process that reported, and which ones a ready deployment needs."""

    def __init__(
        self,
        tokenizer_workers: int,
        stale_after_s: float = STALE_AFTER_S,
        gpu_workers: int = 1,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        # role → how many READY processes of that role a ready deployment needs
        self.required = {
            "gpu_worker": gpu_workers,
            "codec_worker": gpu_workers,
            "tokenizer_worker": tokenizer_workers,
        }
        self.stale_after_s = stale_after_s
        self.heartbeat_timeout_s = max(heartbeat_timeout_s, stale_after_s)
        self._entries: dict[str, _Entry] = {}
        self._dead: set[str] = set()  # reported dead, not heard from since
        self._refused: set[str] = set()  # names whose status was dropped (logged once each)
        self.forget_after_s = max(FORGET_AFTER_S, 6 * self.heartbeat_timeout_s)

    def refusal(self, st: ProcStatus) -> str:
        """Why the table does not take `st` ("" when it does): a role it does not know, a name or
        a number no real process sends."""
        if st.role not in ROLES:
            return f"role {st.role!r} is none of {', '.join(ROLES)}"
        if not _NAME.fullmatch(st.name):
            return "a name outside [A-Za-z0-9_.:-]{1,128}"
        if not (0 < st.pid < 2**31 and 0 <= st.capacity <= MAX_SLOTS and 0 <= st.load <= MAX_SLOTS):
            return f"pid {st.pid}, capacity {st.capacity}, load {st.load} out of range"
        if len(st.metrics) > MAX_METRICS:
            return f"{len(st.metrics)} metrics (at most {MAX_METRICS})"
        for key, value in st.metrics.items():
            if not _METRIC_NAME.fullmatch(key) or not (math.isfinite(value) and abs(value) <= MAX_METRIC):
                return f"metric {key[:70]!r} = {value!r}"
        if st.name not in self._entries and len(self._entries) >= MAX_PROCESSES:
            return f"{MAX_PROCESSES} processes reported already"
        return ""

    def update(self, status: ProcStatus) -> bool:
        """Record a status; True when it comes from a new instance that replaced one whose death
        was not noticed yet (a restart faster than the heartbeat timeout). A status `refusal`
        names is dropped (and logged once per name)."""
        why = self.refusal(status)
        if why:
            key = status.name[:128]
            if key not in self._refused and len(self._refused) < MAX_PROCESSES:
                self._refused.add(key)
                log.warning("dropped a status from %r: %s", key, why)
            return False
        if len(status.detail) > MAX_DETAIL:
            status.detail = status.detail[:MAX_DETAIL] + "…"
        old = self._entries.get(status.name)
        # Another instance: another pid, or another PID namespace (a restarted container's first
        # process has the pid its predecessor had).
        new = old is not None and (old.status.pid, old.status.host) != (status.pid, status.host)
        replaced = new and status.name not in self._dead
        if new:
            self._dead.discard(status.name)
        if old is not None and not new:
            start = old.start
        elif status.host and status.host == HOST_ID:
            start = process_start(status.pid)
        else:
            start = REMOTE
        self._entries[status.name] = _Entry(status, time.monotonic(), start)
        return replaced

    def newly_dead(self) -> list[str]:
        """Processes that died since the last call: FAILED, exited (on this host), or silent for
        `heartbeat_timeout_s` without saying goodbye. Each death is reported once (again only after
        the process was heard from alive)."""
        now = time.monotonic()
        dead: set[str] = set()
        for name, e in self._entries.items():
            gone = e.status.state != ProcState.STOPPING and (
                now - e.received > self.heartbeat_timeout_s or e.exited()
            )
            if gone or e.status.state == ProcState.FAILED:
                if name not in self._dead:
                    dead.add(name)
                    self._dead.add(name)
            else:
                self._dead.discard(name)
        return sorted(dead)

    def ready(self, name: str) -> bool:
        """Whether the process last heard from under `name` is READY and not known to be gone."""
        e = self._entries.get(name)
        return (
            e is not None and e.status.state == ProcState.READY and name not in self._dead and not e.exited()
        )

    def ready_names(self, role: str) -> list[str]:
        """The processes of `role` that are READY and not known to be gone, by name."""
        return sorted(n for n, e in self._entries.items() if e.status.role == role and self.ready(n))

    def seen_dead(self, name: str) -> bool:
        """Whether `newly_dead` has reported the process under `name` dead (and it has not been
        heard from since): its requests were failed then, and one handed to it later is not."""
        return name in self._dead

    def fresh_metrics(self) -> list[tuple[str, str, dict[str, float]]]:
        """(name, role, metrics) of every process heard from within `stale_after_s`: a process
        that went quiet must not keep showing its last KV pages and queue."""
        now = time.monotonic()
        return [
            (name, e.status.role, dict(e.status.metrics))
            for name, e in list(self._entries.items())
            if now - e.received <= self.stale_after_s and e.status.metrics
        ]

    def stream_capacity(self) -> float | None:
        """Concurrent streams the gpu_workers can serve: each one's measured `stream_capacity`
        (heartbeat metrics), else its max batch size; None while no gpu_worker has said. A worker
        that went quiet still counts (it is usually being restarted, and its requests fail anyway)."""
        total, known = 0.0, False
        workers = [e.status for e in self._entries.values() if e.status.role == "gpu_worker"]
        # No more gpu_workers than the deployment has (the ones heard from last), none claiming
        # more streams than its slots.
        workers.sort(key=lambda st: -self._entries[st.name].received)
        for st in [st for st in workers if st.state != ProcState.STOPPING][: self.required["gpu_worker"]]:
            cap = float(st.metrics.get("stream_capacity", 0.0)) or float(st.capacity)
            cap = min(cap, float(st.capacity or MAX_SLOTS))
            if cap > 0 and math.isfinite(cap):
                total, known = total + cap, True
        return total if known else None

    def report(self) -> tuple[bool, list[dict[str, Any]]]:
        """(ready, one row per process: the gateway, every reporter, then expected ones missing)."""
        now = time.monotonic()
        rows: list[dict[str, Any]] = [
            {
                "name": "gateway",
                "role": "gateway",
                "pid": os.getpid(),
                "state": "ready",
                "detail": "",
                "age_s": 0.0,
            }
        ]
        n_ready = dict.fromkeys(self.required, 0)
        n_seen = dict.fromkeys(self.required, 0)
        for name, entry in list(self._entries.items()):
            st, age = entry.status, now - entry.received
            stale = age > self.stale_after_s
            exited = entry.exited()
            if (stale or exited) and st.state == ProcState.STOPPING or age > self.forget_after_s:
                # It said goodbye (a tokenizer worker leaving the pool), or died long ago: forget it.
                del self._entries[name]
                self._dead.discard(name)
                continue
            state = "exited" if exited else "unresponsive" if stale else st.state.name.lower()
            if st.role in n_seen:
                n_seen[st.role] += 1
                n_ready[st.role] += state == "ready"
            rows.append(
                {
                    "name": name,
                    "role": st.role,
                    "pid": st.pid,
                    "state": state,
                    "detail": st.detail,
                    "age_s": round(age, 3),
                }
            )
        for role, need in self.required.items():
            for name in _missing_names(role, need, n_seen[role], self._entries):
                rows.append(
                    {"name": name, "role": role, "pid": None, "state": "missing", "detail": "", "age_s": None}
                )
        ready = all(n_ready[role] >= need for role, need in self.required.items())
        return ready, rows


def _missing_names(role: str, need: int, seen: int, entries: dict[str, _Entry]) -> list[str]:
    """Placeholder names for expected processes that never reported (`tokenizer_worker.N`)."""
    if seen >= need:
        return []
    if role == "tokenizer_worker" or need > 1:  # a pool, or several pairs: members are numbered
        candidates = [f"{role}.{i}" for i in range(need + len(entries))]
    else:
        candidates = [role]
    return [name for name in candidates if name not in entries][: need - seen]
