"""Chat fine-tuning and Hugging Face ``datasets`` sources for the training recipes: conversations
rendered with the checkpoint's own chat template (sandboxed) to the token ids ``transformers``
gives, a loss over the assistant's tokens only, clear errors for bad rows, and data read from
``save_to_disk`` directories and parquet files. Everything is local: a tokenizer trained here, a
tiny random Llama, templates written for these tests."""

import json
import os
import pathlib
import shutil

import equinox as eqx
import jax
import numpy as np
import pytest

import zoo
from recipes import finetune_hf
from recipes._lm import chat, data
from recipes._lm.flags import saved_flags
from recipes._lm.run import Run, batch_loss

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecation notices

FAST = ["--batch", "4", "--seq", "32", "--eval-every", "1000", "--eval-batches", "1", "--log-every", "1"]
FAST += ["--save-every", "0", "--quiet-samples", "--steps", "2", "--warmup", "0"]

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
SPECIALS += ["<|im_start|>", "<|im_end|>", "<s>", "</s>"]

# Three template texts in the shapes real checkpoints ship, written for these tests.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% set ns = namespace(turn=0) %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if (message['role'] == 'user') != (ns.turn % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{% set ns.turn = ns.turn + 1 %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
TEMPLATES = {"llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"), "chatml": (CHATML, None, "<|im_end|>")}
TEMPLATES["mistral"] = (MISTRAL, "<s>", "</s>")

CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does os.path.join do?"},
        {"role": "assistant", "content": "It joins path parts with the separator."},
        {"role": "user", "content": "And os.getcwd?"},
        {"role": "assistant", "content": "It returns the current directory: é, ü work too."},
    ],
    [
        {"role": "user", "content": "Name a function of os."},
        {"role": "assistant", "content": "os.listdir lists a directory."},
    ],
]


def _fast_tokenizer(bos, eos):
    """A byte-level BPE tokenizer (about 300 tokens) with the chat special tokens, in transformers' wrapper."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([pathlib.Path(os.__file__).read_text()[:20000]], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)


def _write(d: pathlib.Path, name: str, *, in_config: bool) -> pathlib.Path:
    """A tiny random Llama checkpoint with the template ``name``, in ``chat_template.jinja`` or
    (``in_config``) in ``tokenizer_config.json``."""
    template, bos, eos = TEMPLATES[name]
    d.mkdir(parents=True)
    _fast_tokenizer(bos, eos).save_pretrained(d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    if in_config:
        config = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    else:
        (d / "chat_template.jinja").write_text(template)
    cfg = zoo.config_from_name("llama:tiny", vocab_size=320)
    zoo.save_hf(zoo.build_model(cfg, key=jax.random.key(0)), d)
    return d


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {name: _write(root / name, name, in_config=name == "chatml") for name in TEMPLATES}


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("chatdata") / "chat.jsonl"
    rows = [{"messages": CONVERSATIONS[i % 2]} for i in range(40)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def _template(directory) -> chat.ChatTemplate:
    return data.chat_template(data.HFTokenizer(directory), "test")


# ---------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_token_ids_equal_transformers_apply_chat_template_and_the_mask_is_the_assistants(checkpoints, name):
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(checkpoints[name])
    template = _template(checkpoints[name])
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=True, return_dict=False)
        ids, mask, _ = template.encode(messages)
        assert ids.tolist() == list(expected)
        # The masked tokens spell the assistant's messages, each with the template's closing token.
        spans, run = [], []
        for token, keep in zip(ids.tolist(), mask.tolist(), strict=True):
            if keep:
                run.append(token)
            elif run:
                spans.append(reference.decode(run))
                run = []
        spans += [reference.decode(run)] if run else []
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [s.strip() for s in spans] == [a + TEMPLATES[name][2] for a in answers]
        ids_all, no_mask, _ = template.encode(messages, assistant_only=False)
        assert no_mask is None and ids_all.tolist() == ids.tolist()


def test_a_template_reaching_for_python_internals_is_refused(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["llama3"], bad)
    (bad / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SystemExit, match=r"refused by the sandbox: .*__class__.*not code"):
        _template(bad).encode(CONVERSATIONS[1])
    # The data given to a template is read-only: a template changing it is refused too.
    (bad / "chat_template.jinja").write_text("{% set _ = messages.append({'role': 'user'}) %}{{ messages }}")
    with pytest.raises(SystemExit, match="refused by the sandbox"):
        _template(bad).encode(CONVERSATIONS[1])
    (bad / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(SystemExit, match="does not parse"):
        _template(bad).encode(CONVERSATIONS[1])


def test_bad_chat_rows_and_a_checkpoint_without_a_template_are_one_line(checkpoints, chat_jsonl, tmp_path):
    common = ["--out", str(tmp_path / "run"), *FAST]
    good = json.dumps({"messages": CONVERSATIONS[1]})
    rows = tmp_path / "rows.jsonl"
    rows.write_text(good + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(SystemExit, match=r"rows.jsonl: line 2 has no field 'messages' \(its fields: 'prompt'"):
        finetune_hf.main([str(checkpoints["llama3"]), "--data", str(rows), *common])
    rows.write_text(json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}) + "\n")
    with pytest.raises(SystemExit, match=r"line 1: message 0 has the unknown role 'wizard'; roles: system, user"):
        finetune_hf.main([str(checkpoints["llama3"]), "--data", str(rows), *common])
    rows.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(SystemExit, match=r"line 1 has no field 'text' or 'messages'"):
        finetune_hf.main([str(checkpoints["llama3"]), "--data", str(rows), *common])
    bare = tmp_path / "bare"
    shutil.copytree(checkpoints["chatml"], bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    with pytest.raises(SystemExit, match=r"bare has no chat template \(no chat_template.jinja"):
        finetune_hf.main([str(bare), "--data", str(chat_jsonl), *common])
    with pytest.raises(SystemExit, match=r"--train-on: invalid choice: .some. \(choose from .assistant., .all.\)"):
        finetune_hf.main([str(checkpoints["llama3"]), "--data", str(chat_jsonl), *common, "--train-on", "some"])
    with pytest.raises(SystemExit, match=r"holds conversations .* give a checkpoint directory"):
        data.open_corpus(str(chat_jsonl), data.ByteTokenizer(), limit=None, seed=0)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.safetensors"))


# ---------------------------------------------------------------------------- training


def test_masked_positions_receive_no_gradient_and_a_chat_finetune_trains(
    checkpoints, chat_jsonl, tmp_path, monkeypatch
):
    from test_trackers import wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ckpt = checkpoints["llama3"]
    flags = ["--data", str(chat_jsonl), "--out", str(tmp_path / "run"), *FAST, "--tracker", "wandb"]
    summary = finetune_hf.main([str(ckpt), *flags, "--export-dtype", "bfloat16"])
    assert all(np.isfinite(v) for v in summary["losses"].values()) and len(summary["losses"]) == 2
    # The W&B run's config is every flag, the fine-tuning recipe's own included.
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    (record,) = [r.run for r in wandb_records(str(run_file)) if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in record.config.update}
    assert config["export_dtype"] == "bfloat16" and config["train_on"] == "assistant" and config["model"] == str(ckpt)
    run = Run(saved_flags(str(tmp_path / "run")))
    corpus = run.corpus
    assert corpus.train_mask is not None and 0 < corpus.train_mask.mean() < 1
    batch = run.batch("train", 1, 0)  # packed (the default): the conversations' segment ids too
    tokens, mask = batch["tokens"], batch["mask"]
    assert tokens.shape == (4, 33) and mask.shape == (4, 32) and 0 < int(mask.sum()) < mask.size
    assert batch["segment_ids"].shape == (4, 33)
    # The loss covers the assistant's tokens: its closing <|eot_id|>, never a header's token.
    targets, on = np.asarray(tokens)[:, 1:], np.asarray(mask)
    eot, header = (run.tokenizer._tok.token_to_id(t) for t in ("<|eot_id|>", "<|start_header_id|>"))
    assert np.any(targets[on] == eot) and not np.any(targets[on] == header) and np.any(targets[~on] == header)
    # The last target of each row feeds no later position: changing it changes no gradient when
    # the mask leaves it out, and changes them when the mask covers it.
    # (compiled once: run eagerly, each of the model's operations was dispatched on its own)
    grad = eqx.filter_jit(eqx.filter_grad(lambda m, b: batch_loss(zoo.lm_loss_and_metrics)(m, b)[0]))
    model, changed = run.model, np.asarray(tokens).copy()
    changed[:, -1] = (changed[:, -1] + 7) % 300
    for covered in (False, True):
        last = np.asarray(mask).copy()
        last[:, -1] = covered
        same = grad(model, {**batch, "mask": jax.numpy.asarray(last)})
        other = grad(model, {**batch, "tokens": jax.numpy.asarray(changed), "mask": jax.numpy.asarray(last)})
        equal = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(other), strict=True)]
        assert all(equal) if not covered else not all(equal)
    # ... and the gradient of the loss with respect to each position's logits is zero where masked.
    logits = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(model, tokens[:, :-1])
    dlogits = jax.grad(lambda x: zoo.cross_entropy(x, tokens[:, 1:], mask))(logits)
    per_position = np.abs(np.asarray(dlogits)).sum(-1)
    assert np.all(per_position[~np.asarray(mask)] == 0) and np.all(per_position[np.asarray(mask)] > 0)
    # --train-on all: every token in the loss.
    everything = data.open_corpus(str(chat_jsonl), run.tokenizer, limit=None, seed=0, train_on="all")
    assert everything.train_mask is None and len(everything.train) == len(corpus.train)


# ---------------------------------------------------------------------------- datasets


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    return datasets


def test_save_to_disk_directories_and_parquet_files_give_the_tokens_of_the_jsonl(
    checkpoints, chat_jsonl, tmp_path, datasets_cache
):
    datasets = datasets_cache
    tok = data.HFTokenizer(checkpoints["llama3"])
    paragraphs = [p for p in pathlib.Path(os.__file__).read_text().split("\n\n") if p.strip()][:60]
    jsonl = tmp_path / "notes.jsonl"
    jsonl.write_text("".join(json.dumps({"body": p, "id": i}) + "\n" for i, p in enumerate(paragraphs)))
    ds = datasets.Dataset.from_dict({"body": paragraphs, "id": list(range(len(paragraphs)))})
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    ds.to_parquet(str(tmp_path / "notes.parquet"))
    (tmp_path / "shards").mkdir()
    ds.select(range(30)).to_parquet(str(tmp_path / "shards" / "a.parquet"))
    ds.select(range(30, 60)).to_parquet(str(tmp_path / "shards" / "b.parquet"))
    expected = data.open_corpus(str(jsonl), tok, limit=None, seed=0, field="body")
    for source in ("saved", "dict", "notes.parquet", "shards"):
        corpus = data.open_corpus(str(tmp_path / source), tok, limit=None, seed=0, field="body")
        np.testing.assert_array_equal(corpus.train, expected.train)
        np.testing.assert_array_equal(corpus.val, expected.val)
        assert corpus.train_mask is None
    with pytest.raises(SystemExit, match=r"no column 'text' or 'messages' \(its columns: body, id; see --data-field"):
        data.open_corpus(str(tmp_path / "saved"), tok, limit=None, seed=0)
    with pytest.raises(SystemExit, match=r"row 0: field 'id' is neither text nor a list of messages"):
        data.open_corpus(str(tmp_path / "notes.parquet"), tok, limit=None, seed=0, field="id")
    with pytest.raises(SystemExit, match=r"notes.parquet: no column 'title' \(its columns: body, id"):
        flags = ["--data", str(tmp_path / "notes.parquet"), "--data-field", "title", *FAST]
        finetune_hf.main([str(checkpoints["llama3"]), *flags, "--out", str(tmp_path / "run")])
    # Conversations in a dataset column: the same tokens and mask as the chat .jsonl. A field only
    # some messages have is None in the others (a column of structs): dropped, as transformers does.
    rows = [json.loads(line) for line in chat_jsonl.read_text().splitlines()]
    assert chat.check_messages([{"role": "user", "content": "a", "name": None}], "row") == [
        {"role": "user", "content": "a"}
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "chat"))
    from_jsonl = data.open_corpus(str(chat_jsonl), tok, limit=None, seed=0)
    from_disk = data.open_corpus(str(tmp_path / "chat"), tok, limit=None, seed=0, field="messages")
    np.testing.assert_array_equal(from_disk.train, from_jsonl.train)
    np.testing.assert_array_equal(from_disk.train_mask, from_jsonl.train_mask)


def test_datasets_are_read_in_batches_of_rows_not_whole(tmp_path, datasets_cache, monkeypatch):
    datasets = datasets_cache
    datasets.Dataset.from_dict({"text": [f"document {i} " * 3 for i in range(2500)]}).save_to_disk(str(tmp_path / "d"))
    seen = []
    iterate = datasets.Dataset.iter

    def spy(self, batch_size, *args, **kwargs):
        for batch in iterate(self, batch_size, *args, **kwargs):
            seen.append(len(next(iter(batch.values()))))
            yield batch

    monkeypatch.setattr(datasets.Dataset, "iter", spy)
    corpus = data.open_corpus(str(tmp_path / "d"), data.ByteTokenizer(), limit=None, seed=0)
    assert seen == [1000, 1000, 500] and len(corpus.train) + len(corpus.val) == sum(
        len(f"document {i} " * 3) for i in range(2500)
    )
    seen.clear()
    data.open_corpus(str(tmp_path / "d"), data.ByteTokenizer(), limit=5000, seed=0)
    assert seen == [1000]  # a byte cap stops reading


def test_a_pretokenized_bin_file_trains_with_every_token_in_the_loss(tmp_path):
    from recipes import train_lm

    tokens = np.frombuffer(pathlib.Path(os.__file__).read_bytes()[:20000], np.uint8).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    flags = ["--data", str(tmp_path / "train.bin"), "--data-dtype", "uint16", "--out", str(tmp_path / "run")]
    summary = train_lm.main([*flags, *FAST, "--eval-every", "2", "--no-pack"])  # bytes: no end token
    assert len(summary["losses"]) == 2 and summary["val"] and all(np.isfinite(v) for v in summary["val"].values())
