"""What the language-model recipes share: ``data`` (corpus, tokenizers, deterministic batches),
``run_setup`` (model, mesh, processes, optimizer, offload) and ``monitor`` (progress bar, JSONL
log, plots)."""
