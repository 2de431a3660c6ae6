"""CURVE keys for tcp:// sockets: encryption, and authentication of every peer.

`voxpipe keys DIR` writes a server keypair, a client keypair and DIR/authorized (the client public
keys a server admits). With `use_curve(DIR)` every tcp:// socket `common.ipc.make_socket` makes is
a CURVE server (binding) that admits only authorized clients through a ZAP handler, or a client
(connecting) that pins the server's public key. `common.ipc.secure_sockets` decides whether a
process needs it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Any

import zmq

log = logging.getLogger(__name__)

CURVE_SERVER, CURVE_CLIENT, CURVE_AUTHORIZED = "server", "client", "authorized"


class CurveKeys:
    """The keys `voxpipe keys DIR` writes: every binding socket is a CURVE server with the
    deployment's server keypair and admits only clients whose public key is in DIR/authorized;
    every connecting socket is a client with DIR/client.key_secret and pins the server's public key."""

    def __init__(self, key_dir: str) -> None:
        from zmq.auth import load_certificate

        p = os.path.join
        try:
            self.server_public, self.server_secret = load_certificate(
                p(key_dir, CURVE_SERVER + ".key_secret")
            )
            self.client_public, self.client_secret = load_certificate(
                p(key_dir, CURVE_CLIENT + ".key_secret")
            )
        except (OSError, ValueError) as e:
            raise ValueError(
                f"--zmq-curve-dir {key_dir!r}: cannot load its keys ({e}); create them with `voxpipe keys {key_dir}`"
            ) from None
        self.authorized = p(key_dir, CURVE_AUTHORIZED)
        if not os.path.isdir(self.authorized):
            raise ValueError(f"--zmq-curve-dir {key_dir!r} has no {CURVE_AUTHORIZED}/ of client public keys")
        self._auths: dict[int, Any] = {}  # underlying context → its ZAP authenticator thread

    def apply(self, ctx: zmq.Context, sock: zmq.Socket, bind: bool) -> None:
        sock.curve_secretkey = self.server_secret if bind else self.client_secret
        sock.curve_publickey = self.server_public if bind else self.client_public
        if bind:
            self._authenticate(ctx)
            sock.curve_server = True
        else:
            sock.curve_serverkey = self.server_public

    def _authenticate(self, ctx: zmq.Context) -> None:
        """One ZAP handler per context (asyncio contexts share theirs through a sync shadow)."""
        if ctx.underlying in self._auths:
            return
        from zmq.auth import load_certificates
        from zmq.utils import z85

        allowed = {z85.decode(key) for key in load_certificates(self.authorized)}
        self._auths[ctx.underlying] = ZapHandler(zmq.Context.shadow(ctx.underlying), allowed)

    def close(self) -> None:
        for auth in self._auths.values():
            auth.stop()
        self._auths.clear()


class ZapHandler:
    """The ZAP handler (ZeroMQ RFC 27) of one context: admits a CURVE client whose public key is
    one of `allowed`, refuses every other peer. A thread with a blocking REP socket: pyzmq's
    ThreadAuthenticator runs an asyncio loop in its thread, and under CPU load it was seen to stop
    answering (handshakes of new peers then hang, and their messages never arrive)."""

    ENDPOINT = "inproc://zeromq.zap.01"

    def __init__(self, ctx: zmq.Context, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self._refused: set[bytes] = set()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.ENDPOINT)  # before any CURVE server binds: its handshakes ask here
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(200):
                continue
            frames = self._sock.recv_multipart()
            # version, request id, domain, address, routing id, mechanism, credentials (a CURVE
            # client's public key, 32 bytes)
            ok = len(frames) >= 7 and frames[5] == b"CURVE" and frames[6] in self.allowed
            if not ok and len(self._refused) < 100 and frames[3:4] and frames[3] not in self._refused:
                self._refused.add(frames[3])  # said once per address: a refused peer retries often
                log.warning(
                    "refused a ZeroMQ peer at %s: no authorized CURVE key", frames[3].decode(errors="replace")
                )
            status, text = (b"200", b"OK") if ok else (b"400", b"no authorized CURVE key")
            self._sock.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", status, text, b"", b""])
        self._sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


_curve: CurveKeys | None = None


def use_curve(key_dir: str) -> None:
    """Encrypt and authenticate every tcp:// socket made from now on with the keys in `key_dir`
    (`--zmq-curve-dir`); "" turns it off. ipc:// sockets are unaffected (the 0700 run directory
    guards them). Raises ValueError naming the setting when the keys are missing."""
    global _curve
    if _curve is not None:
        _curve.close()
    _curve = CurveKeys(key_dir) if key_dir else None
    if _curve is not None:
        log.info("tcp:// sockets use CURVE keys from %s", key_dir)


def ensure_curve_keys(key_dir: str) -> bool:
    """Create `key_dir` with fresh keys when it does not exist; True when this process did. Made
    in a temporary directory and renamed into place, so processes starting at once on a shared
    volume all load the one set that won."""
    import shutil

    if os.path.exists(key_dir):
        return False
    parent = os.path.dirname(os.path.abspath(key_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".voxpipe-keys-", dir=parent)
    create_curve_keys(tmp)
    try:
        os.rename(tmp, key_dir)
        return True
    except OSError:  # another process's keys are there first
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def create_curve_keys(key_dir: str) -> list[str]:
    """`voxpipe keys DIR`: the server and client keypairs, and the client's public key authorized.
    Existing keys are kept. Returns the files written."""
    import shutil

    from zmq.auth import create_certificates

    os.makedirs(os.path.join(key_dir, CURVE_AUTHORIZED), mode=0o700, exist_ok=True)
    os.chmod(key_dir, 0o700)
    written = []
    for name in (CURVE_SERVER, CURVE_CLIENT):
        if not os.path.exists(os.path.join(key_dir, name + ".key_secret")):
            public, secret = create_certificates(key_dir, name)
            os.chmod(secret, 0o600)
            written += [public, secret]
    allowed = os.path.join(key_dir, CURVE_AUTHORIZED, CURVE_CLIENT + ".key")
    if not os.path.exists(allowed):
        shutil.copyfile(os.path.join(key_dir, CURVE_CLIENT + ".key"), allowed)
        written.append(allowed)
    return written


def apply(ctx: zmq.Context, sock: zmq.Socket, bind: bool) -> None:
    """Make a tcp:// socket a CURVE server or client, when `use_curve` is on."""
    if _curve is not None:
        _curve.apply(ctx, sock, bind)
