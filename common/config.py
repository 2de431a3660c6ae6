"""Settings shared by every process of one deployment.

`voxpipe serve` parses the command line once into a `ServeConfig` and hands it to each child as
JSON (`--config-json`), so all processes agree on the model, the limits and the addresses.
"""

from __future__ import annotations

import msgspec

from common.ipc import Addresses


class ServeConfig(msgspec.Struct, kw_only=True):
    model: str = "orpheus-tiny"
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer_workers: int = 1
    device: str = "auto"  # gpu_worker: "cpu", "cuda", "cuda:N"; auto = cuda if available
    codec_device: str = "auto"  # codec_worker; auto = the gpu_worker's device
    load_format: str = "auto"  # auto (real weights) | dummy (random weights of the real shape)
    weights: str = ""  # LM checkpoint: Hugging Face id or local directory ("" = the model's default)
    codec_weights: str = ""  # codec checkpoint, likewise
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    max_batch_size: int = 0  # 0 = 256 on GPU, 16 on CPU
    max_context: int = 0  # 0 = the model's max_tokens
    page_size: int = 16
    num_pages: int = 0  # 0 = enough for max_batch_size full contexts
    constrained: bool | None = None  # None = the model's default
    max_text_chars: int = 2000
    max_queue: int = 1024  # requests waiting for a slot beyond this get 503
    log_level: str = "INFO"
    disable_cuda_graph: bool = False
    addresses: Addresses | None = None
    run_dir: str = ""

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        return msgspec.json.decode(text, type=cls)


def resolve_device(device: str) -> str:
    """`auto` → cuda when torch sees a GPU, else cpu. Imports torch lazily (GPU-side callers only)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def program_kwargs(cfg: ServeConfig) -> dict:
    """The keyword arguments every process builds its program with."""
    return dict(
        load_format=cfg.load_format, weights=cfg.weights or None, codec_weights=cfg.codec_weights or None
    )
