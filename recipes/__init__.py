"""Recipes: train, fine-tune and evaluate language models with the public API of ``zoo`` and ``transforms``.

Run them as modules from anywhere once the project is installed:

```bash
python -m recipes.train_lm                        # a tiny Llama on the standard library's source
python -m recipes.finetune_hf path/to/hf_checkpoint --data notes/ --export out/hf
python -m recipes.evaluate runs/llama-tiny-20261202-120000
```

The shared pieces (data, model and optimizer set-up, progress and plots) are in ``recipes._lm``.
"""
