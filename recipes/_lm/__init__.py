"""What the language-model recipes share: ``flags`` (the training flags and their checks),
``offload`` (the offload set, parsed once), ``run`` (a run's model, data and optimizer), ``train``
(the training loop), ``loading`` and ``export`` (models in and out), ``data`` (corpus, tokenizers,
deterministic batches), ``run_setup`` (model, mesh, processes, optimizer), ``memory`` (sizes against
this machine), ``files`` (whole-file writes, the run lock, output paths), ``monitor`` (progress bar,
JSONL log, plots), ``trackers``, ``chat``, ``cli`` (one-line errors) and ``zoo_lm`` (the
lm-evaluation-harness model)."""
