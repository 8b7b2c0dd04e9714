"""Fine-tuning real Hugging Face checkpoints with ``recipes.finetune_hf``, fully and with LoRA: the data
sources, the flags that used to be ignored, clear errors for bad input, exports that ``transformers``
and ``peft`` load, and resuming a LoRA run from its adapter-only checkpoint."""

import contextlib
import io
import json
import os
import pathlib
import shutil

import equinox as eqx
import jax
import numpy as np
import pytest

import transforms
import zoo
from recipes import finetune_hf, generate
from recipes._lm import data
from recipes._lm.run_setup import decay_mask

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecation notices

FAST = ["--batch", "4", "--seq", "32", "--eval-every", "1000", "--eval-batches", "1", "--log-every", "1"]
FAST += ["--save-every", "0", "--quiet-samples"]


def _tokenizer():
    """A small byte-level BPE tokenizer (300 tokens, with bos and eos) in transformers' wrapper."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|bos|>", "<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([pathlib.Path(os.__file__).read_text()], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")


def _write_checkpoint(d: pathlib.Path, fast, *, tied: bool) -> pathlib.Path:
    """A tiny random Llama written by transformers with a real-shaped config: llama3 rope scaling,
    131072 positions, bf16 weights in two safetensors shards with an index, the tokenizer ``fast``
    (with bos and eos tokens), and a generation config."""
    import torch
    import transformers

    d.mkdir(parents=True)
    fast.save_pretrained(d)
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        tie_word_embeddings=tied,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(d, max_shard_size="150KB" if not tied else "100KB")
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) == 2 and (d / "model.safetensors.index.json").is_file(), shards
    return d


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, fast = tmp_path_factory.mktemp("hf"), _tokenizer()
    return {name: _write_checkpoint(root / name, fast, tied=name == "tied") for name in ("untied", "tied")}


@pytest.fixture(scope="module")
def notes(tmp_path_factory):
    """A .jsonl of documents (paragraphs of Python's os module)."""
    paragraphs = [p for p in pathlib.Path(os.__file__).read_text().split("\n\n") if p.strip()][:150]
    path = tmp_path_factory.mktemp("data") / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return path


def leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ---------------------------------------------------------------------------- data


def test_jsonl_documents_are_joined_with_the_eos_token_and_nothing_is_capped(checkpoints, notes):
    tok = data.HFTokenizer(checkpoints["tied"])
    assert tok.eos_id == 1  # "<|eos|>", from tokenizer_config.json
    corpus = data.open_corpus(str(notes), tok, limit=None, seed=0)
    docs = [json.loads(line)["text"] for line in notes.read_text().splitlines()]
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(checkpoints["tied"] / "tokenizer.json"))
    expected = sum(len(reference.encode(d, add_special_tokens=False).ids) + 1 for d in docs)
    tokens = np.concatenate([corpus.train, corpus.val])
    assert len(tokens) == expected and np.sum(tokens == 1) == len(docs)
    assert not any("at most" in n for n in corpus.notes)
    capped = data.open_corpus(str(notes), tok, limit=2000, seed=0)
    assert "reading at most 2,000 bytes" in capped.notes[0] and len(capped.train) < len(corpus.train) / 5


def test_a_directory_mixes_text_files_and_jsonl_and_the_byte_tokenizer_adds_no_separator(tmp_path, notes):
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "b.md").write_text("beta " * 50)
    shutil.copy(notes, tmp_path / "c.jsonl")
    (tmp_path / ".hidden").write_text("never read")
    corpus = data.open_corpus(str(tmp_path), data.ByteTokenizer(), limit=None, seed=1)
    texts = [json.loads(line)["text"] for line in notes.read_text().splitlines()]
    assert len(corpus.train) + len(corpus.val) == 300 + 250 + sum(len(t.encode()) for t in texts)


def test_a_pretokenized_bin_file_is_memory_mapped_with_its_dtype_from_a_flag_or_a_sidecar(tmp_path):
    ids = (np.arange(10_000) * 7919 % 256).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(SystemExit, match="--data-dtype"):
        data.open_corpus(str(tmp_path / "train.bin"), data.ByteTokenizer(), limit=None, seed=0)
    corpus = data.open_corpus(str(tmp_path / "train.bin"), data.ByteTokenizer(), limit=None, seed=0, dtype="uint16")
    assert isinstance(corpus.train, np.memmap) and len(corpus.val) == 500
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]), ids)
    batch = data.batch_at(corpus.train, 3, batch=2, seq=8, seed=0)
    assert batch.shape == (2, 9) and (batch == data.batch_at(corpus.train, 3, batch=2, seq=8, seed=0)).all()
    ids[:2000].tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text('{"dtype": "uint16"}')
    corpus = data.open_corpus(str(tmp_path / "train.bin"), data.ByteTokenizer(), limit=None, seed=0)
    assert len(corpus.train) == 10_000 and len(corpus.val) == 2000
    (ids.astype(np.uint32) + 300).tofile(tmp_path / "big.bin")
    with pytest.raises(SystemExit, match="token id 555 is outside the tokenizer's vocabulary of 256"):
        data.open_corpus(str(tmp_path / "big.bin"), data.ByteTokenizer(), limit=None, seed=0, dtype="uint32")


def test_weight_decay_applies_to_matrices_and_adapters_only():
    model = transforms.lora(
        zoo.abstract_model(zoo.LlamaConfig.preset("tiny", qkv_bias=True)), rank=2, alpha=4, key=jax.random.key(0)
    )
    mask = decay_mask(model)(eqx.filter(model, transforms.trainable_mask(model)))
    assert mask.stack.layers.attn.q_proj.lora_a and mask.stack.layers.attn.q_proj.lora_b
    full = zoo.abstract_model(zoo.LlamaConfig.preset("tiny", qkv_bias=True))
    m = decay_mask(full)(full)
    assert m.embed.weight and m.lm_head.weight and m.stack.layers.mlp.up.weight and m.stack.layers.attn.k_proj.weight
    assert not m.norm.weight and not m.stack.layers.attn_norm.weight and not m.stack.layers.attn.q_proj.bias


# ---------------------------------------------------------------------------- bad input


def test_bad_input_is_one_clear_line_before_anything_is_loaded(checkpoints, notes, tmp_path):
    common = ["--data", str(notes), "--out", str(tmp_path / "run"), *FAST]
    with pytest.raises(SystemExit, match=r"--seq 200000 is longer than the 131072 positions"):
        finetune_hf.main([str(checkpoints["tied"]), *common, "--seq", "200000"])
    with pytest.raises(SystemExit, match=r"--seq 1000000 is longer than the 128 positions of llama:tiny"):
        from recipes.train_lm import main as train_main

        train_main(["--model", "llama:tiny", "--seq", "1000000", "--out", str(tmp_path / "tiny")])
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    with pytest.raises(SystemExit, match="model_type 'bert' is not supported; supported model types: gpt2, llama"):
        finetune_hf.main([str(bert), *common])
    small = tmp_path / "small"
    shutil.copytree(checkpoints["tied"], small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    from tokenizers import Tokenizer

    n_tokens = Tokenizer.from_file(str(small / "tokenizer.json")).get_vocab_size()
    with pytest.raises(SystemExit, match=f"has {n_tokens} tokens, more than the 100 rows"):
        finetune_hf.main([str(small), *common])
    with pytest.raises(SystemExit, match="--export-merged needs --lora-rank"):
        finetune_hf.main([str(checkpoints["tied"]), *common, "--export-merged", str(tmp_path / "m")])
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.safetensors"))


# ---------------------------------------------------------------------------- end to end


def _logits_transformers(directory, tokens, **kwargs):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(torch.tensor(tokens[None])).logits[0].numpy()


def _logits_zoo(model, tokens):
    return np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, jax.numpy.asarray(tokens)))


@pytest.fixture(scope="module")
def lora_run(checkpoints, notes, tmp_path_factory):
    """LoRA on the tied checkpoint (fp32 base) with the base and optimizer state offloaded."""
    root = tmp_path_factory.mktemp("lora")
    # --no-pack: packing makes attention take a document mask, and float32 rounding between the
    # offloaded and the device program then shows through Adam at lr 3e-2 (7e-4 relative on 1 of 512
    # adapter elements after 4 steps), past the resume test's bound; packing has its own tests.
    flags = [str(checkpoints["tied"]), "--data", str(notes), *FAST, "--steps", "4", "--lr", "3e-2", "--warmup", "1"]
    flags += ["--no-pack"]
    flags += ["--lora-rank", "4", "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate,up,down"]
    flags += ["--base-dtype", "float32", "--export-dtype", "float32"]
    exports = ["--export", str(root / "adapter"), "--export-merged", str(root / "merged")]
    sampling = [f for f in flags if f != "--quiet-samples"] + ["--sample-before"]  # 131072 positions
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = finetune_hf.main([*sampling, "--offload", "params,opt_state", "--out", str(root / "run"), *exports])
    return {"flags": flags, "summary": summary, "root": root, "printed": printed.getvalue()}


def test_lora_finetuning_samples_before_and_after_with_the_kv_cache(lora_run):
    lines = lora_run["printed"].splitlines()
    before = [line for line in lines if line.startswith("sample before training:")]
    after = [line for line in lines if line.startswith("sample:")]
    assert len(before) == 3 and len(after) == 3, lines


def test_generate_recipe_streams_the_merged_exports_greedy_text(lora_run, capsys):
    merged = lora_run["root"] / "merged"
    flags = ["--model", str(merged), "--prompt", "def main(", "--max-new-tokens", "8", "--no-stop"]
    result = generate.main([*flags, "--offload", "params", "--cache-memory-kind", "pinned_host"])
    tokenizer = data.HFTokenizer(merged)
    prompt = jax.numpy.asarray(tokenizer.encode(b"def main("))
    expected = zoo.generate(zoo.load_hf(merged), prompt, max_new_tokens=8)
    assert result["new_ids"] == [int(t) for t in expected]
    assert capsys.readouterr().out == "def main(" + tokenizer.decode(expected) + "\n"
    # --offload params loads the checkpoint straight into offload_params' placement.
    loaded, _, _ = generate.load(str(merged), step=None, dtype=None, offload=True)
    placed = transforms.offload_params(zoo.load_hf(merged))
    kinds = lambda m: [x.sharding.memory_kind for x in jax.tree.leaves(m)]
    assert kinds(loaded) == kinds(placed) and "pinned_host" in kinds(loaded)


def test_full_finetuning_keeps_float32_master_weights_and_exports_what_transformers_loads(checkpoints, notes, tmp_path):
    import transformers

    export = tmp_path / "export"
    flags = [str(checkpoints["untied"]), "--data", str(notes), *FAST, "--steps", "4", "--lr", "3e-3", "--warmup", "1"]
    summary = finetune_hf.main([*flags, "--out", str(tmp_path / "run"), "--export", str(export)])
    losses = summary["losses"]
    assert losses[4] < losses[1]
    model = summary["model"]
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))} == {np.dtype("float32")}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 4 and all(r["lr"] >= 0 and r["grad_norm"] > 0 for r in train)
    assert train[0]["lr"] < train[1]["lr"]  # warmup
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (export / name).is_file(), name
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == 1
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    tokens = np.asarray(tokenizer("def main(path):\n    return path")["input_ids"])
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"  # the checkpoint's own
    reloaded = zoo.load_hf(export, dtype="float32")
    np.testing.assert_allclose(_logits_transformers(export, tokens), _logits_zoo(reloaded, tokens), atol=1e-4)
    # The export is the trained model, rounded to the checkpoint's bf16.
    trained = np.asarray(model.stack.layers.mlp.up.weight).astype(jax.numpy.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(reloaded.stack.layers.mlp.up.weight), trained)


def test_lora_with_the_base_offloaded_trains_and_exports_a_peft_adapter_and_a_merged_model(checkpoints, lora_run):
    import peft
    import torch
    import transformers

    summary, root = lora_run["summary"], lora_run["root"]
    losses = summary["losses"]
    assert losses[4] < losses[1]
    model = summary["model"]
    q = model.stack.layers.attn.q_proj
    assert q.base.weight.sharding.memory_kind == "pinned_host" and q.lora_a.sharding.memory_kind == "device"
    tokens = np.arange(2, 40) % 300
    ours = _logits_zoo(model, tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["tied"], dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
    with torch.no_grad():
        reference = peft_model(torch.tensor(tokens[None])).logits[0].numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    np.testing.assert_allclose(_logits_transformers(root / "merged", tokens), reference, atol=1e-4, rtol=0)
    assert (root / "merged" / "tokenizer.json").is_file() and (root / "adapter" / "tokenizer_config.json").is_file()


def test_a_lora_run_resumes_from_its_adapter_checkpoint_and_matches_the_offloaded_run(lora_run, tmp_path):
    out = tmp_path / "run"
    first = finetune_hf.main([*lora_run["flags"], "--out", str(out), "--stop-after", "2", "--save-every", "2"])
    assert first["final_step"] == 2 and not first["finished"]
    saved = {p.name for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert saved, "a checkpoint was written"
    resumed = finetune_hf.main([lora_run["flags"][0], "--resume", str(out), "--quiet-samples"])
    assert resumed["start_step"] == 2 and resumed["final_step"] == 4
    expected = leaves(eqx.filter(lora_run["summary"]["model"], transforms.trainable_mask(lora_run["summary"]["model"])))
    got = leaves(eqx.filter(resumed["model"], transforms.trainable_mask(resumed["model"])))
    assert expected.keys() == got.keys() and any("lora_a" in k for k in got)
    for k in expected:  # this run kept the base on the device: the same numbers up to float32 rounding
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-4, atol=1e-6, err_msg=k)


# ---------------------------------------------------------------------------- QLoRA


def test_qlora_finetunes_an_nf4_base_in_host_memory_and_exports_an_adapter_the_dense_base_loads(
    checkpoints, notes, tmp_path
):
    flags = [str(checkpoints["tied"]), "--data", str(notes), *FAST, "--steps", "3", "--lr", "3e-2", "--warmup", "1"]
    flags += ["--lora-rank", "4", "--base-dtype", "float32", "--export-dtype", "float32"]
    with pytest.raises(SystemExit, match="--quantize nf4 needs --lora-rank: quantized weights are frozen"):
        finetune_hf.main([str(checkpoints["tied"]), "--data", str(notes), *FAST, "--quantize", "nf4"])
    summary = finetune_hf.main(
        [
            *flags,
            "--quantize",
            "nf4",
            "--offload",
            "params",
            "--out",
            str(tmp_path / "run"),
            "--export",
            str(tmp_path / "a"),
        ]
    )
    base = summary["model"].stack.layers.attn.q_proj.base.weight
    assert isinstance(base, zoo.nn.QuantizedWeight) and base.codes.sharding.memory_kind == "pinned_host"
    dense = transforms.dequantize(zoo.load_hf(checkpoints["tied"], quantize="nf4", dtype="float32"))
    adapted = zoo.hf.load_peft_adapter(dense, tmp_path / "a")
    tokens = np.arange(1, 12)
    expected = _logits_zoo(transforms.dequantize(summary["model"]), tokens)
    np.testing.assert_allclose(_logits_zoo(adapted, tokens), expected, rtol=1e-4, atol=1e-4)


def test_generate_recipe_with_quantized_weights_gives_the_tokens_of_their_dense_copy(lora_run):
    merged = lora_run["root"] / "merged"
    flags = ["--model", str(merged), "--prompt", "def main(", "--max-new-tokens", "8", "--no-stop"]
    result = generate.main([*flags, "--quantize", "int8"])
    tokenizer = data.HFTokenizer(merged)
    prompt = jax.numpy.asarray(tokenizer.encode(b"def main("))
    dense = transforms.dequantize(zoo.load_hf(merged, quantize="int8"))
    assert result["new_ids"] == [int(t) for t in zoo.generate(dense, prompt, max_new_tokens=8)]
