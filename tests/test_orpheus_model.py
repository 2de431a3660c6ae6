"""Orpheus LM fidelity and token rules.

- `LlamaLM` reproduces transformers' `LlamaForCausalLM` (llama3 RoPE scaling, GQA, tied
  embeddings) when driven through the runtime's attention protocol, in one mixed prefill and in
  token-by-token decode of two interleaved requests;
- `from_pretrained` loads what HF's `save_pretrained` writes;
- `classify` follows the reference decoder's token filter, and `candidates` only offers tokens it
  accepts.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from programs import get_spec
from programs.base import TokenKind
from programs.orpheus.model import LlamaLM
from programs.orpheus.program import OrpheusProgram

# Small, but every llama3 RoPE band is exercised: with theta 5e5 and head_dim 16 the wavelengths
# run from 6 to 6e5 positions, across the 2048 / 8192 band edges.
TINY = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


class ContiguousAttention:
    """The runtime's `attn.forward(layer, q, k, v)` protocol over a plain per-request KV cache:
    rows of the step are laid out request by request (`plan`), each attends causally to its own
    request's cached keys plus the step's."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.segments: list[tuple[int, int]] = []

    def plan(self, segments: list[tuple[int, int]]) -> None:
        self.segments = segments  # (request id, rows this step), in row order

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, row = [], 0
        for rid, n in self.segments:
            past_k, past_v = self.cache.get((layer, rid), (k[:0], v[:0]))
            kk, vv = torch.cat([past_k, k[row : row + n]]), torch.cat([past_v, v[row : row + n]])
            self.cache[(layer, rid)] = (kk, vv)
            rep = q.shape[1] // kk.shape[1]  # GQA: each kv head serves `rep` query heads
            kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)  # [T, Hq, D]
            scores = torch.einsum("nhd,thd->hnt", q[row : row + n], kk) * q.shape[-1] ** -0.5
            t, past = kk.shape[0], kk.shape[0] - n
            mask = torch.arange(t)[None, :] > (past + torch.arange(n))[:, None]  # [n, T]
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            out.append(torch.einsum("hnt,thd->nhd", probs, vv))
            row += n
        return torch.cat(out)


@pytest.fixture(scope="module")
def hf_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, initializer_range=0.2, attn_implementation="eager")).eval()
    with torch.no_grad():  # random norm weights too, so a skipped or misplaced norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _hf_logits(model: LlamaForCausalLM, ids: list[int], start: int) -> torch.Tensor:
    pos = torch.arange(start, start + len(ids))[None]
    with torch.no_grad():
        return model(torch.tensor([ids]), position_ids=pos).logits[0]  # [T, V]


def test_llama_matches_transformers_in_mixed_prefill_and_decode(hf_model: LlamaForCausalLM) -> None:
    lm = LlamaLM.from_state_dict(TINY, hf_model.state_dict())
    assert torch.equal(lm.inv_freq, hf_model.model.rotary_emb.inv_freq)  # llama3 scaling, bit for bit
    gen = torch.Generator().manual_seed(1)
    # Two requests; the second starts at position 5000 to reach the scaled RoPE bands.
    seqs = {0: (torch.randint(0, 300, (12,), generator=gen).tolist(), 0)}
    seqs[1] = (torch.randint(0, 300, (9,), generator=gen).tolist(), 5000)
    expected = {rid: _hf_logits(hf_model, ids, start) for rid, (ids, start) in seqs.items()}

    attn = ContiguousAttention()

    def step(rows: dict[int, range]) -> dict[int, torch.Tensor]:
        ids = torch.tensor([seqs[r][0][i] for r, rr in rows.items() for i in rr])  # [N]
        pos = torch.tensor([seqs[r][1] + i for r, rr in rows.items() for i in rr])  # [N]
        attn.plan([(r, len(rr)) for r, rr in rows.items()])
        with torch.no_grad():
            logits = lm.logits(lm.backbone(lm.embed(ids), pos, attn))  # [N, V]
        return dict(zip(rows, logits.split([len(rr) for rr in rows.values()]), strict=True))

    # Prefill both prompts in one step, then decode them one token per step, together.
    got = step({0: range(0, 6), 1: range(0, 4)})
    logits = {r: [got[r]] for r in got}
    for i in range(5):
        got = step({0: range(6 + i, 7 + i), 1: range(4 + i, 5 + i)})
        for r in got:
            logits[r].append(got[r])
    got = step({0: range(11, 12)})
    logits[0].append(got[0])
    for rid in seqs:
        torch.testing.assert_close(torch.cat(logits[rid]), expected[rid], atol=1e-4, rtol=1e-4)


def test_from_pretrained_loads_save_pretrained_dir(hf_model: LlamaForCausalLM, tmp_path) -> None:
    hf_model.save_pretrained(tmp_path)  # safetensors; the tied lm_head is not stored
    lm = LlamaLM.from_pretrained(str(tmp_path), torch.float32, "cpu")
    ref = hf_model.state_dict()
    ours = lm.state_dict()
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name
    assert lm.lm_head.weight is lm.model.embed_tokens.weight


def test_dummy_weights_are_deterministic_per_seed() -> None:
    a, b, c = (LlamaLM.dummy(TINY, seed=s) for s in (0, 0, 1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.all(pa == 1.0)
        else:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - 0.02) < 0.005, name


# --- token rules ------------------------------------------------------------------------------


def _reference_id(token_string: str, index: int) -> int | None:
    """The reference decoder's turn_token_into_id, ported literally (it works on token text)."""
    token_string = token_string.strip()
    start = token_string.rfind("<custom_token_")
    if start == -1:
        return None
    last = token_string[start:]
    if not (last.startswith("<custom_token_") and last.endswith(">")):
        return None
    try:
        return int(last[14:-1]) - 10 - ((index % 7) * 4096)
    except ValueError:
        return None


def _token_text(tok: int) -> str:
    """What the reference's detokenizer yields: Orpheus' added tokens 128256+ are <custom_token_N>."""
    return f"<custom_token_{tok - 128256}>" if tok >= 128256 else f"word{tok}"


def _reference_kinds(stream: list[int]) -> list[int]:
    kinds, count = [], 0
    for tok in stream:
        if tok == 128258:  # the engine's stop token (the filter itself would skip it)
            kinds.append(TokenKind.STOP)
            continue
        code = _reference_id(_token_text(tok), count)
        if code is not None and code > 0:
            count += 1
            kinds.append(TokenKind.AUDIO)
        else:
            kinds.append(TokenKind.OTHER)
    return kinds


def _random_stream(rnd: random.Random, length: int) -> list[int]:
    stream, count = [], 0
    for _ in range(length):
        slot = count % 7
        choice = rnd.random()
        if choice < 0.5:  # a code of the right slot (0 included)
            tok = 128266 + 4096 * slot + rnd.choice([0, rnd.randrange(4096)])
        elif choice < 0.6:
            tok = 128258
        elif choice < 0.7:  # text or special tokens, the custom tokens below the audio block
            tok = rnd.choice([rnd.randrange(128000), rnd.randrange(128000, 128266)])
        elif choice < 0.8:  # past the audio block (the vocab ends at 156940)
            tok = rnd.randrange(128266 + 7 * 4096, 156940)
        else:  # any slot's code, often not this one's
            tok = 128266 + 4096 * rnd.randrange(7) + rnd.randrange(4096)
        stream.append(tok)
        code = _reference_id(_token_text(tok), count)
        count += tok != 128258 and code is not None and code > 0
    return stream


def test_classify_follows_the_reference_token_filter() -> None:
    program = OrpheusProgram(get_spec("orpheus"))
    rnd = random.Random(0)
    streams = [_random_stream(rnd, 400) for _ in range(4)]
    n_audio = torch.zeros(len(streams), dtype=torch.int64)
    ours: list[list[int]] = [[] for _ in streams]
    for t in range(400):  # classify the four streams as one batch per step, like the runtime
        tokens = torch.tensor([[s[t]] for s in streams], dtype=torch.int64)
        kinds = program.classify(tokens, n_audio)
        assert kinds.dtype == torch.int64
        n_audio += kinds == TokenKind.AUDIO
        for i, k in enumerate(kinds.tolist()):
            ours[i].append(int(k))
    for stream, got in zip(streams, ours, strict=True):
        assert got == _reference_kinds(stream)
    assert {TokenKind.AUDIO, TokenKind.OTHER, TokenKind.STOP} <= {k for g in ours for k in g}


def test_candidates_are_only_accepted_audio_tokens_or_stop() -> None:
    program = OrpheusProgram(get_spec("orpheus-tiny"))
    n_audio = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 13, 700], dtype=torch.int64)
    cands = program.candidates(n_audio)  # [B, 4096]
    assert cands.shape == (10, 4096) and cands.dtype == torch.int64
    for row, n in zip(cands.numpy(), n_audio.numpy(), strict=True):
        assert len(set(row.tolist())) == 4096
        assert row.max() < program.vocab_size
        kinds = program.classify(torch.from_numpy(row[:, None]), torch.full((4096,), int(n))).numpy()
        assert (kinds == TokenKind.STOP).sum() == 1
        assert (kinds == TokenKind.AUDIO).sum() == 4095
        codes = row[kinds == TokenKind.AUDIO] - 128266 - 4096 * (n % 7)
        assert codes.min() == 1 and codes.max() == 4095  # decodable: the window stays valid
