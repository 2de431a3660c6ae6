"""Attention over the paged KV cache behind one interface (`interface`): torch (CPU), FlashInfer
and XQA (GPU); `select` picks the backend a runner gets."""
