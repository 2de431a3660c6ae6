"""Qwen3-TTS's talker and code predictor (programs/qwen3_tts/model.py) equal the reference's
`Qwen3TTSTalkerForConditionalGeneration` (qwen-tts-compat, for transformers 5) for the same random
weights (qwen3-tts-tiny, CPU fp32): codebook-0 logits over a prompt and the frames after it, each
frame's input carrying its text column (text rows, then the tts pad row), through the paged KV
cache; and the code predictor's greedy codebooks 1..15 of every frame. MRoPE with three different
position rows equals the reference's, interleaved and in sections. Without the reference: the code
predictor's frames do not depend on the batch, and a sharded checkpoint loads every talker weight.

The reference installs without its dependencies (`pip install --no-deps qwen-tts-compat==0.1.1.post1`,
plus `librosa`, which its modeling file imports) and runs on transformers 5.9-5.23; the test skips
where it is missing or cannot run.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from gpu_worker.attention.interface import StepLayout
from gpu_worker.attention.torch_paged import TorchPagedAttention
from gpu_worker.runner.kv_cache import allocate_kv_cache
from programs.blocks.qwen3 import mrope_cos_sin, mrope_rows
from programs.qwen3_tts.model import Qwen3TtsLM
from tests.qwen3_tts_reference import reference_module as _reference

CONFIG = os.path.join(
    os.path.dirname(__file__), "..", "programs", "qwen3_tts", "configs", "qwen3-tts-tiny.json"
)
PAGE = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def config() -> dict:
    with open(CONFIG) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def ref(config):
    mod = _reference()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSTalkerConfig

    torch.manual_seed(0)
    talker = mod.Qwen3TTSTalkerForConditionalGeneration(
        Qwen3TTSTalkerConfig(**config["talker_config"])
    ).eval()
    with torch.no_grad():  # every weight random, norms and biases too, so none can be left out unseen
        for name, p in talker.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return talker


@pytest.fixture(scope="module")
def ours(config, ref):
    lm = Qwen3TtsLM(config)
    lm._check_complete(lm.load_weights(("talker." + k, v) for k, v in ref.state_dict().items()))
    return lm.eval()


class Paged:
    """One request's rows through the runtime's paged KV cache and torch attention."""

    def __init__(self, lm: Qwen3TtsLM, context: int) -> None:
        a = lm.model.layers[0].self_attn
        pages = -(-context // PAGE)
        kv = allocate_kv_cache(
            len(lm.model.layers), 1 + pages, PAGE, a.num_kv_heads, a.head_dim, torch.float32, "cpu"
        )
        self.lm, self.attn, self.table, self.length = (
            lm,
            TorchPagedAttention(kv, a.num_heads),
            list(range(1, 1 + pages)),
            0,
        )

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        pos = torch.arange(self.length, self.length + n)
        self.length += n
        self.attn.plan(StepLayout([0, n], [self.length], [self.table], pos))
        return self.lm.backbone(rows, pos, self.attn)


def greedy(logits: torch.Tensor, salt: int) -> torch.Tensor:
    return logits.argmax(-1)


def test_talker_logits_and_greedy_codebooks_equal_the_reference(config, ref, ours):
    tc = config["talker_config"]
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(0, 151_000, (7,), generator=gen)
    specials = [tc["codec_think_id"], tc["codec_think_bos_id"], tc["codec_language_id"]["english"]]
    specials += [tc["codec_think_eos_id"], tc["spk_id"]["ryan"], tc["codec_pad_id"], tc["codec_bos_id"]]
    with torch.no_grad():
        # A prompt of text rows, codec rows and their sums, as the reference's generate builds one.
        t_rows = ours.text_rows(text)
        c_rows = ours.codec_rows(torch.tensor(specials))
        prompt = torch.cat([t_rows[:3], t_rows[3:] + c_rows[:4], c_rows[4:]])  # [P, H]
        columns = ours.text_rows(torch.randint(0, 151_000, (3,), generator=gen))  # trailing text rows
        pad = ours.text_rows(torch.tensor([config["tts_pad_token_id"]]))  # [1, H]
        torch.testing.assert_close(
            ref.text_projection(ref.get_text_embeddings()(text)), t_rows, rtol=1e-6, atol=1e-6
        )

        p = prompt.shape[0]
        out = ref(
            inputs_embeds=prompt[None], attention_mask=torch.ones(1, p, dtype=torch.long), use_cache=True
        )
        paged = Paged(ours, p + 8)
        hidden = paged.forward(prompt)
        torch.testing.assert_close(ours.logits(hidden), out.logits[0], rtol=1e-5, atol=1e-5)
        cache, past_hidden = out.past_key_values, out.past_hidden
        for step in range(6):  # 3 frames carry text rows, the rest the pad row
            c0 = out.logits[0, -1, :2048].argmax()[None]
            out = ref(
                input_ids=c0[None],
                attention_mask=torch.ones(1, p + step + 1, dtype=torch.long),
                past_key_values=cache,
                past_hidden=past_hidden,
                trailing_text_hidden=columns[None],
                tts_pad_embed=pad[None],
                generation_step=step,
                subtalker_dosample=False,
                use_cache=True,
            )
            cache, past_hidden = out.past_key_values, out.past_hidden
            want_codes = out.hidden_states[1][0]  # [C]: c0, then the predictor's greedy codebooks

            frame = ours.predict(hidden[-1:], c0, greedy)  # [1, C]
            assert frame[0].tolist() == want_codes.tolist(), f"frame {step}"
            column = columns[step : step + 1] if step < len(columns) else pad
            hidden = paged.forward(ours.frame_rows(frame) + column)
            torch.testing.assert_close(ours.logits(hidden), out.logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [True, False])
def test_mrope_with_three_position_rows_equals_the_reference(interleaved):
    mod = _reference()
    sections, d = [4, 2, 2], 16
    gen = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 500, (3, 9), generator=gen)  # [3, N] temporal, height, width
    q, k = torch.randn(1, 4, 9, d, generator=gen), torch.randn(1, 2, 9, d, generator=gen)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = (inv[None, None, :, None] @ pos[:, None, None, :].float()).transpose(2, 3)  # [3, 1, N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    want_q, want_k = mod.apply_multimodal_rotary_pos_emb(q, k, emb.cos(), emb.sin(), sections, interleaved)

    cos, sin = mrope_cos_sin(inv, pos, mrope_rows(sections, interleaved), torch.float32)  # [N, D]
    rot = mod.rotate_half
    torch.testing.assert_close(q * cos + rot(q) * sin, want_q, rtol=0, atol=0)
    torch.testing.assert_close(k * cos + rot(k) * sin, want_k, rtol=0, atol=0)


def test_code_predictor_frames_do_not_depend_on_the_batch(config):
    ours = Qwen3TtsLM.dummy(config, torch.float32, "cpu", seed=3)  # runs without the reference too
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, ours.hidden_size, generator=gen)
    c0 = torch.randint(0, 2048, (3,), generator=gen)
    with torch.no_grad():
        batched = ours.predict(hidden, c0, greedy)
        alone = torch.cat([ours.predict(hidden[i : i + 1], c0[i : i + 1], greedy) for i in range(3)])
    assert batched.shape == (3, 16) and batched.tolist() == alone.tolist()
    assert len(set(batched[:, 1:].flatten().tolist())) > 10, "random weights give varied codes"


def test_a_checkpoint_directory_loads_every_talker_weight(config, tmp_path):
    from safetensors.torch import save_file

    src = Qwen3TtsLM.dummy(config, torch.float32, "cpu", seed=4)
    shards = {f"talker.{k}": v.contiguous() for k, v in src.state_dict().items()}
    names = sorted(shards)
    half = len(names) // 2
    save_file({k: shards[k] for k in names[:half]}, str(tmp_path / "model-1.safetensors"))
    rest = {k: shards[k] for k in names[half:]}
    rest["speaker_encoder.fc.weight"] = torch.zeros(2, 2)  # a Base checkpoint's, passed over
    save_file(rest, str(tmp_path / "model-2.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    lm = Qwen3TtsLM.from_pretrained(str(tmp_path), torch.float32, "cpu")
    for k, v in src.state_dict().items():
        assert torch.equal(lm.state_dict()[k], v), k
    save_file({k: shards[k] for k in names[1:]}, str(tmp_path / "model-1.safetensors"))
    with pytest.raises(KeyError, match="lacks 1 weights"):
        Qwen3TtsLM.from_pretrained(str(tmp_path), torch.float32, "cpu")
