"""The saved voices' directory (gateway.voices): a name is never a path, a voice is written whole or
not at all (its JSON last, renamed into place) and read back as written, a file that does not read
back is skipped, and a voice belongs to the model that encoded it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from common.arrays import np_array, wire_array
from gateway.voices import SavedVoice, VoiceError, VoiceStore


def voice(name: str, model: str = "csm-tiny") -> SavedVoice:
    codes = np.arange(64, dtype=np.int32).reshape(2, 32)
    speaker = np.linspace(-1, 1, 8, dtype=np.float32)
    return SavedVoice(
        name, model, "What it says.", {"codes": wire_array(codes), "speaker": wire_array(speaker)}
    )


@pytest.mark.parametrize(
    "name",
    ["../escape", "a/b", "a\\b", ".hidden", "trailing.", "", "x" * 65, "sp ace", "a..b", "nul\x00", "é"],
)
def test_a_name_that_could_be_a_path_is_refused(tmp_path, name: str) -> None:
    store = VoiceStore(str(tmp_path / "voices"))
    with pytest.raises(VoiceError) as e:
        store.save(voice(name), taken=set())
    assert e.value.status == 400
    assert os.listdir(tmp_path / "voices") == [] and os.listdir(tmp_path) == ["voices"]


def test_a_voice_reads_back_as_written_and_only_for_its_model(tmp_path) -> None:
    root = str(tmp_path)
    store = VoiceStore(root)
    store.save(voice("me.v2"), taken={"0", "1"})
    store.save(voice("other", model="qwen3-tts-base-tiny"), taken=set())
    with pytest.raises(VoiceError) as e:
        store.save(voice("1"), taken={"0", "1"})
    assert e.value.status == 409
    assert sorted(os.listdir(root)) == sorted(
        [
            "me.v2.json",
            "me.v2.codes.npy",
            "me.v2.speaker.npy",
            "other.json",
            "other.codes.npy",
            "other.speaker.npy",
        ]
    )
    again = VoiceStore(root)  # as a restarted gateway reads it
    assert again.names("csm-tiny") == ["me.v2"] and again.names("qwen3-tts-base-tiny") == ["other"]
    assert again.get("other", "csm-tiny") is None
    got, want = again.get("me.v2", "csm-tiny"), voice("me.v2")
    assert got.text == want.text and got.model == "csm-tiny"
    for name in want.features:
        a, b = np_array(got.features[name]), np_array(want.features[name])
        assert a.dtype == b.dtype and np.array_equal(a, b)
    with pytest.raises(VoiceError) as e:
        again.delete("other", "csm-tiny")  # another model's voice is none of this one's
    assert e.value.status == 404
    again.delete("me.v2", "csm-tiny")
    assert sorted(os.listdir(root)) == ["other.codes.npy", "other.json", "other.speaker.npy"]


def test_a_voice_that_does_not_read_back_is_skipped(tmp_path) -> None:
    root = str(tmp_path)
    store = VoiceStore(root)
    for name in ("good", "torn", "lying"):
        store.save(voice(name), taken=set())
    os.remove(os.path.join(root, "torn.speaker.npy"))  # a feature file lost
    with open(os.path.join(root, "lying.json"), "w") as f:  # a JSON naming another voice's files
        f.write('{"name": "good", "model": "csm-tiny", "ref_text": "", "created": 0, "features": {}}')
    with open(os.path.join(root, ".tmp-abc"), "wb") as f:  # a write cut short before its rename
        f.write(b"partial")
    assert VoiceStore(root).names("csm-tiny") == ["good"]
