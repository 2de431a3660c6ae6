"""Building blocks that model programs share; a model imports from here, never from another model.

- `llama`: the Llama decoder pieces (parameters, Linear through `fp8.linear`, Embedding, RMSNorm,
  attention over the runtime's paged cache, MLP, DecoderLayer, the unfused `decoder_stack`);
- `qwen3`: the Qwen3 layer (QK-norm) and multimodal RoPE (MRoPE) on top of the Llama pieces;
- `rope`: rotary embeddings (default and llama3 scaling), as transformers computes them;
- `fp8`: float8 linear layers and `rows_apart` (GEMM row groups of a mixed step);
- `weights`: finding a checkpoint and copying named weights into a module;
- `text_tokenizer`: the checkpoint's `tokenizer.json`, or an offline byte-level BPE stand-in;
- `rng`: counter-based random numbers for the sampler and codec noise;
- `mimi_encoder`: Kyutai Mimi's encoder (audio → codes), batched clips of different lengths;
- `audio`: the clip encoders' resampler (torchaudio's arithmetic) and Slaney mel filterbank.
"""
