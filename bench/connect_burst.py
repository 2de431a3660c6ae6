"""N clients connecting to a running server at once, each on a new connection: how long each waits
for its connection and for its `/health` answer. It measures the gateway's accept queue
(`--listen-backlog`, held to the kernel's `net.core.somaxconn`): connections beyond it have their
SYNs dropped and connect only on the client's retry, ~1 s later, which is then part of a burst's
time to first audio. The connects go out as fast as one thread issues them (non-blocking sockets,
no HTTP library between), so the client is never slower than the gateway's accept loop and the
queue fills as it would under many clients.

    voxpipe bench connect --url http://127.0.0.1:8000 --clients 384 [--rounds 3] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import time
from urllib.parse import urlsplit

import numpy as np

from common.proc import kernel_backlog_cap

RETRY_S = 0.9  # a wait this long is a SYN retry (Linux's first is after 1 s), not a slow accept
TIMEOUT_S = 15.0


def one_round(host: str, port: int, clients: int) -> tuple[list[float], list[float]]:
    """Every client connects at once, then asks for /health → (seconds each waited for its
    connection, seconds each waited for its answer), from when the first connect went out."""
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    sel = selectors.DefaultSelector()
    connected: dict[socket.socket, float] = {}
    answered: dict[socket.socket, float] = {}
    replies: dict[socket.socket, bytes] = {}
    t0 = time.perf_counter()
    socks = []
    try:
        for _ in range(clients):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, port))
            socks.append(s)
            sel.register(s, selectors.EVENT_WRITE)
        while len(answered) < clients and time.perf_counter() - t0 < TIMEOUT_S:
            for ready, _ in sel.select(0.1):
                s = ready.fileobj
                if s not in connected:
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        raise ConnectionError(f"a connection to {host}:{port} failed")
                    connected[s] = time.perf_counter() - t0
                    s.sendall(request)
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                data = s.recv(65536)
                replies[s] = replies.get(s, b"") + data
                if not data or b"\r\n\r\n" in replies[s]:
                    answered[s] = time.perf_counter() - t0
                    sel.unregister(s)
                    if not replies[s].startswith(b"HTTP/1.1 200"):
                        raise ConnectionError(f"/health answered {replies[s][:40]!r}")
    finally:
        sel.close()
        for s in socks:
            s.close()
    if len(answered) < clients:
        raise TimeoutError(f"{clients - len(answered)} of {clients} clients got no answer in {TIMEOUT_S} s")
    return list(connected.values()), list(answered.values())


def summary(connect: list[float], answer: list[float]) -> dict:
    c, a = np.array(connect) * 1000, np.array(answer) * 1000
    return {
        "connections": len(c),
        "connect_p50_ms": round(float(np.percentile(c, 50)), 1),
        "connect_p99_ms": round(float(np.percentile(c, 99)), 1),
        "connect_max_ms": round(float(c.max()), 1),
        "retried": int((c >= 1000 * RETRY_S).sum()),
        "answer_p50_ms": round(float(np.percentile(a, 50)), 1),
        "answer_p90_ms": round(float(np.percentile(a, 90)), 1),
        "answer_p99_ms": round(float(np.percentile(a, 99)), 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=3, help="bursts, one after another (a pause between)")
    ap.add_argument("--label", default="", help="what was measured (e.g. the server's --listen-backlog)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    rounds, connects, answers = [], [], []
    for _ in range(args.rounds):
        c, a = one_round(host, port, args.clients)
        rounds.append(summary(c, a))
        connects += c
        answers += a
        time.sleep(1.0)  # the connections closed: the next burst finds an empty queue
    out = {
        "label": args.label,
        "url": args.url,
        "clients": args.clients,
        "rounds": rounds,
        "all": summary(connects, answers),
        "somaxconn": kernel_backlog_cap(),  # the client's host: the server's where both are one
    }
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
