"""Train a language model on local text, with checkpoints, resume, progress and plots.

By default a tiny byte-level Llama learns the Python standard library's own source (found
through `sysconfig`: no download), in about two minutes on 2 CPU cores:

    python -m recipes.train_lm
    python -m recipes.train_lm --model gpt2:tiny --steps 500 --data path/to/text_or_dir
    python -m recipes.train_lm --offload params,opt_state,activations     # state in host memory
    python -m recipes.train_lm --offload params,opt_state_stream          # the update streamed per layer
    python -m recipes.train_lm --offload opt_state_defer                  # ... in the next forward pass
    python -m recipes.train_lm --plan h100                                # the planner chooses
    python -m recipes.train_lm --moments bfloat16 --plan auto             # 16-bit AdamW moments
    python -m recipes.train_lm --mesh data=2,fsdp=4                       # 8 devices
    python -m recipes.train_lm --resume runs/llama-tiny-20261202-120000   # continue a run
    python -m recipes.train_lm --resume runs/llama-tiny-20261202-120000 --steps 600 --lr 1e-3
    python -m recipes.train_lm --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0

Each run writes to ``--out`` (default ``runs/<model>-<time>``): ``checkpoints/`` (orbax; the
last ``--keep``; model, optimizer state, step, RNG, data position and every flag, so
``--resume DIR`` needs nothing else), ``metrics.jsonl``, ``loss.png`` (training and validation
loss in bits per byte, with the unigram baseline), ``placement.png`` (device vs host bytes of
params, gradients, optimizer state, activations) and ``orbax.log`` (the checkpoint library's own
log messages, kept off the terminal); with ``--tracker tensorboard,wandb`` also ``tensorboard/``
event files and a ``wandb/`` run holding the metrics of ``metrics.jsonl``. The directory is
locked while the run uses it (``run.lock``): a second run there is refused, naming the first.

``--resume DIR`` takes every flag from the run's checkpoint; flags given with it change what may
change mid-run (the schedule, clipping, checkpoints, evaluation, logging), each change printed
(``--lr: 0.003 -> 0.001``); the others (the model, the data, the batch, the mesh, the offload set,
``--moments``) are refused, saying why. The learning rate of every step is the schedule of the
current flags at that step: a longer ``--steps`` re-stretches the decay over the new length.

A mistake on the command line is one line on stderr and a nonzero exit, before anything runs. The
pieces live in ``recipes._lm``: ``flags`` (the flags and their checks), ``offload`` (the offload
set), ``run`` (the model, data and optimizer of a run) and ``train`` (the loop).
"""

from __future__ import annotations

from recipes._lm.flags import build_parser as build_parser
from recipes._lm.run_setup import one_line_warnings
from recipes._lm.train import main as main

if __name__ == "__main__":
    one_line_warnings()
    main()
