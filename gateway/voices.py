"""Saved voices: a reference clip encoded once, kept under a name, usable as `voice` in any request.

A saved voice is what the model's encoders made of a clip (its features, `common.messages.Array`s),
the clip's text, and the served model's name (features fit only the model that made them). With
--voices-dir they are kept on disk, one `<name>.json` (text, model, the features' dtypes and
shapes) beside one `<name>.<feature>.npy` per feature (np.save, no pickle), each written to a
temporary file and renamed into place, the JSON last: a voice whose JSON is there is whole. The
directory is read at start, so a restart keeps them; without it they live as long as the gateway.

Names are 1-64 of [A-Za-z0-9_-] (with "." inside), so a name is never a path; one that is a
built-in voice of the model (or an OpenAI alias of one) is refused, as is one already saved.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from common.arrays import np_array, wire_array
from common.messages import Array

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}[A-Za-z0-9_-]|[A-Za-z0-9]")
FEATURE = re.compile(r"[A-Za-z0-9_]{1,64}")
MAX_VOICES = 10_000


class VoiceError(ValueError):
    """A voice that cannot be saved or found; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class SavedVoice:
    name: str
    model: str
    text: str
    features: dict[str, Array]
    created: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> dict[str, object]:
        """The voice as the API lists it."""
        return {
            "name": self.name,
            "object": "voice",
            "model": self.model,
            "ref_text": self.text,
            "created": self.created,
        }


def check_name(name: str) -> None:
    if not NAME.fullmatch(name) or ".." in name:
        raise VoiceError(
            400,
            f"voice name {name[:80]!r} is not 1-64 of letters, digits, '_', '-' and '.' (not at either end)",
        )


class VoiceStore:
    """The saved voices by name, and their directory (`root`; "" keeps them in memory only)."""

    def __init__(self, root: str = "") -> None:
        self.root = root
        self.voices: dict[str, SavedVoice] = {}
        if root:
            os.makedirs(root, mode=0o700, exist_ok=True)
            self._load()

    def names(self, model: str) -> list[str]:
        """The voices saved for `model`, by name."""
        return sorted(n for n, v in self.voices.items() if v.model.lower() == model.lower())

    def get(self, name: str, model: str) -> SavedVoice | None:
        v = self.voices.get(name)
        return v if v is not None and v.model.lower() == model.lower() else None

    def check_free(self, name: str, taken: set[str]) -> None:
        """Raise VoiceError unless `name` is a valid name no voice has (`taken`: the model's own)."""
        check_name(name)
        if name in taken:
            raise VoiceError(409, f"{name!r} is a built-in voice of the model; choose another name")
        if name in self.voices:
            raise VoiceError(409, f"a voice named {name!r} is saved already; DELETE it first")

    def save(self, voice: SavedVoice, taken: set[str]) -> None:
        """Keep `voice` (on disk too, with a root). `taken`: the model's built-in voice names."""
        self.check_free(voice.name, taken)
        if len(self.voices) >= MAX_VOICES:
            raise VoiceError(507, f"{MAX_VOICES} voices are saved; delete some first")
        bad = [n for n in voice.features if not FEATURE.fullmatch(n)]
        if bad:
            raise VoiceError(500, f"the encoders named a feature {bad[0]!r}, which cannot be a file name")
        if self.root:
            self._write(voice)
        self.voices[voice.name] = voice

    def delete(self, name: str, model: str) -> SavedVoice:
        check_name(name)
        voice = self.get(name, model)
        if voice is None:
            raise VoiceError(404, f"no saved voice named {name!r} for {model}")
        if self.root:
            _remove(self._path(f"{name}.json"))  # first: without it, the rest is no voice
            for feature in voice.features:
                _remove(self._path(f"{name}.{feature}.npy"))
        del self.voices[name]
        return voice

    def _path(self, leaf: str) -> str:
        return os.path.join(self.root, leaf)

    def _write(self, voice: SavedVoice) -> None:
        for feature, array in voice.features.items():
            _atomic(
                self._path(f"{voice.name}.{feature}.npy"),
                lambda f, a=array: np.save(f, np_array(a), allow_pickle=False),
            )
        meta = {
            "name": voice.name,
            "model": voice.model,
            "ref_text": voice.text,
            "created": voice.created,
            "features": {n: {"dtype": a.dtype, "shape": a.shape} for n, a in voice.features.items()},
        }
        _atomic(self._path(f"{voice.name}.json"), lambda f: f.write(json.dumps(meta).encode()))

    def _load(self) -> None:
        for leaf in sorted(os.listdir(self.root)):
            if not leaf.endswith(".json"):
                continue
            try:
                voice = self._read(leaf)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("voices: skipped %s: %s", leaf, e)
                continue
            self.voices[voice.name] = voice
        if self.voices:
            log.info("voices: %d saved voices in %s", len(self.voices), self.root)

    def _read(self, leaf: str) -> SavedVoice:
        with open(self._path(leaf), "rb") as f:
            meta = json.loads(f.read())
        name = str(meta["name"])
        check_name(name)
        if leaf != f"{name}.json":
            raise ValueError(f"it names the voice {name!r}")
        features = {}
        for feature, shape in meta["features"].items():
            if not FEATURE.fullmatch(feature):
                raise ValueError(f"feature name {feature!r}")
            a = np.load(self._path(f"{name}.{feature}.npy"), allow_pickle=False)
            if list(a.shape) != list(shape["shape"]) or a.dtype.str != shape["dtype"]:
                raise ValueError(
                    f"feature {feature!r} is {a.dtype.str} {list(a.shape)}, not as its JSON says"
                )
            features[feature] = wire_array(a)
        return SavedVoice(name, str(meta["model"]), str(meta["ref_text"]), features, int(meta["created"]))


def _atomic(path: str, write) -> None:
    """Write `path` through a temporary file in its directory, renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
