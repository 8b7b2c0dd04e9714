"""The README's Python examples and the public docstring examples run as written."""

import pathlib
import re
import textwrap

import pytest

import checkpointing
import transforms
import zoo
import zoo.hf

ROOT = pathlib.Path(__file__).parents[1]


def python_blocks(text: str) -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)]


def test_readme_examples_run_in_order(capsys):
    namespace: dict = {}
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 2
    for block in blocks:
        if block.startswith("# illustration:"):
            continue
        exec(compile(block, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "pinned_host" in out and "host -> device" in out


PUBLIC = [
    zoo.GPT2,
    zoo.Llama,
    zoo.GPT2Config,
    zoo.LlamaConfig,
    zoo.lm_loss,
    zoo.lm_loss_and_metrics,
    zoo.abstract_model,
    zoo.load_hf,
    zoo.save_hf,
    zoo.hf,
    zoo.hf.load_hf_tokenizer,
    zoo.nn.Stack,
    zoo.nn.Remat,
    zoo.nn.layer_runner,
    zoo.nn.logical_axes,
    zoo.sharding,
    transforms,
    transforms.offload_params,
    checkpointing.Checkpointer,
    zoo.config_from_name,
    transforms.offload_activations,
    transforms.offload_opt_state,
    transforms.TrainStep,
    transforms.memory_report,
    transforms.transfer_report,
    transforms.plan,
    transforms.plan_generate,
    zoo.generate,
    zoo.generate_slots,
    zoo.decode_step,
    zoo.nn.attend,
    zoo.nn.segment_positions,
    zoo.nn.resolve_attention,
    zoo.nn.cudnn_max_head_dim,
    zoo.nn.cache_axes,
    zoo.nn.per_layer,
    zoo.chunked_cross_entropy,
    zoo.loss_chunk_for,
    zoo.nn.SwiGLU,
    transforms.Plan.apply,
    transforms.Plan.predict,
    transforms.custom_device,
    transforms.compiled_memory,
    zoo.describe,
    zoo.ModelSpec,
    zoo.ModelSpec.from_stack,
    zoo.LayerSpec,
    zoo.Qwen3,
    zoo.Qwen3Config,
    zoo.Qwen3Moe,
    zoo.Qwen3MoeConfig,
    zoo.Mixtral,
    zoo.MixtralConfig,
    zoo.Gemma2,
    zoo.Gemma2Config,
    zoo.Gemma3,
    zoo.Gemma3Config,
    zoo.nn.MoE,
    zoo.nn.router_losses,
    zoo.nn.GeGLU,
    zoo.nn.OffsetRMSNorm,
    transforms.lora,
    transforms.merge_lora,
    transforms.freeze,
    transforms.unfreeze,
    transforms.is_frozen,
    transforms.trainable_mask,
    zoo.nn.LoRALinear,
    zoo.hf.save_peft_adapter,
    zoo.hf.load_peft_adapter,
    zoo.hf.read_config,
    zoo.hf.read_tensors,
    zoo.auto_chunk_tokens,
    zoo.nn.on_host,
    zoo.nn.any_on_host,
    zoo.nn.use_param,
    zoo.nn.param_fetch,
    zoo.nn.is_arraylike,
    zoo.nn.memory_space,
    zoo.nn.var_memory_space,
    zoo.nn.trainable_params,
    zoo.nn.add_lora,
    transforms.OffloadedOptimizer,
    zoo.nn.prefetch_scan,
    transforms.stack_matrix_state,
]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: getattr(o, "__name__", str(o)))
def test_docstring_examples_run(obj):
    blocks = python_blocks(obj.__doc__ or "")
    assert blocks, f"{obj} has no example in its docstring"
    for block in blocks:
        if "needs 8 devices" in block:
            continue
        exec(compile(block, f"{getattr(obj, '__name__', obj)} docstring", "exec"), {})


def test_every_public_name_has_a_docstring():
    for module in (zoo, zoo.nn, zoo.sharding, transforms, checkpointing):
        for name in getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]:
            obj = getattr(module, name)
            if callable(obj) or isinstance(obj, type):
                assert (obj.__doc__ or "").strip(), f"{module.__name__}.{name} has no docstring"


def test_the_docs_name_only_configurations_and_results_that_exist():
    """A configuration of the accelerator check named in the README or the offload-speed notes
    exists (renamed ones would leave their figures unfindable), as does every results file the
    README names by path. Names shaped like configurations that are the recipes' ``--offload``
    choices, or a report's field, are not configurations."""
    from benchmarks.accelerator_check.configs import config_table
    from recipes._lm.offload import OFFLOADABLE

    names = {c.name for c in config_table()} | set(OFFLOADABLE) | {"remat_policy"}
    shaped = r"`((?:all_three|params|opt_state|act|capacity|remat)[a-z0-9_]*)`"
    for doc in ("README.md", "docs/OFFLOAD_SPEED.md"):
        text = (ROOT / doc).read_text()
        unknown = sorted(set(re.findall(shaped, text)) - names)
        assert not unknown, (doc, unknown)
    paths = set(re.findall(r"`(benchmarks/results/[^`*{}]+)`", (ROOT / "README.md").read_text()))
    assert paths and not [p for p in paths if not (ROOT / p).exists()]
