"""recipes.lm_eval: a zoo model scored by lm-evaluation-harness on a local task gives the per-sample
log-likelihoods and the accuracy of lm-eval's own ``hf`` model on the same checkpoint."""

import json
import os
import pathlib

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from recipes import lm_eval as zoo_lm_eval  # noqa: E402

QUESTIONS = [
    ("The cat sat on the", ["mat", "moon", "idea"], 0),
    ("Two plus two is", [" four", " seven"], 0),
    ("import os\nimport", [" sys", " banana", " json"], 2),
    ("def main(", ["):", "x, y):"], 1),
]
TEXTS = ["import os\nprint(os.getcwd())\n", "def f(x):\n    return x + 1\n"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny float32 Llama with a small BPE tokenizer (bos and eos), written by transformers."""
    import os

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|bos|>", "<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([pathlib.Path(os.__file__).read_text()], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    d = tmp_path_factory.mktemp("lm_eval") / "ckpt"
    fast.save_pretrained(d)
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,  # short: the rolling task runs in several windows
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Local tasks: a multiple choice, a rolling log-likelihood and a generation, on JSON lines."""
    d = tmp_path_factory.mktemp("tasks")
    choice = d / "choice.jsonl"
    choice.write_text("".join(json.dumps({"q": q, "choices": c, "gold": g}) + "\n" for q, c, g in QUESTIONS))
    texts = d / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in TEXTS))

    def data(path):
        return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"

    (d / "zoo_choice.yaml").write_text(
        "task: zoo_choice\n" + data(choice) + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n"
    )
    (d / "zoo_rolling.yaml").write_text(
        "task: zoo_rolling\n" + data(texts) + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )
    (d / "zoo_generate.yaml").write_text(
        "task: zoo_generate\n" + data(texts) + "output_type: generate_until\ndoc_to_text: '{{text[:12]}}'\n"
        "doc_to_target: '{{text[12:20]}}'\ngeneration_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 6\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    return d


def _responses(samples):
    return [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_lm_eval_matches_lm_evals_own_hf_model_and_writes_its_files(checkpoint, tasks, tmp_path, capsys):
    from lm_eval.models.huggingface import HFLM

    names = ["zoo_choice", "zoo_rolling", "zoo_generate"]
    out = tmp_path / "results"
    flags = ["--tasks", ",".join(names), "--include-path", str(tasks), "--batch-size", "3"]
    ours = zoo_lm_eval.main([str(checkpoint), *flags, "--output-path", str(out), "--log-samples"])
    hf = HFLM(pretrained=str(checkpoint), batch_size=3, device="cpu", dtype="float32")
    # The same index of lm-eval's tasks (its own TaskManager, built once: building it takes seconds).
    manager = zoo_lm_eval.task_manager(str(tasks))
    theirs = lm_eval.simple_evaluate(model=hf, tasks=names, task_manager=manager, log_samples=True)
    ll_ours = _responses(ours["samples"]["zoo_choice"])
    ll_theirs = _responses(theirs["samples"]["zoo_choice"])
    np.testing.assert_allclose(
        [float(x[0]) for row in ll_ours for x in row], [float(x[0]) for row in ll_theirs for x in row], atol=1e-4
    )
    # (lm-eval writes the samples' responses as text: True, or "True" once written to the files)
    greedy = [[[str(x[1]) == "True" for x in row] for row in lls] for lls in (ll_ours, ll_theirs)]
    assert greedy[0] == greedy[1]
    assert ours["results"]["zoo_choice"]["acc,none"] == theirs["results"]["zoo_choice"]["acc,none"]
    rolling_ours = [float(r[0]) for r in _responses(ours["samples"]["zoo_rolling"])]
    rolling_theirs = [float(r[0]) for r in _responses(theirs["samples"]["zoo_rolling"])]
    np.testing.assert_allclose(rolling_ours, rolling_theirs, atol=1e-4)
    generated = [[str(x) for x in _responses(run["samples"]["zoo_generate"])] for run in (ours, theirs)]
    assert generated[0] == generated[1]
    # lm-eval's own files: the results JSON and one samples file per task
    (model_dir,) = out.iterdir()
    (results_file,) = model_dir.glob("results_*.json")
    assert json.loads(results_file.read_text())["results"]["zoo_choice"]["acc,none"] == pytest.approx(
        ours["results"]["zoo_choice"]["acc,none"]
    )
    assert {p.name.split("_20")[0] for p in model_dir.glob("samples_*.jsonl")} == {f"samples_{n}" for n in names}


def test_lm_eval_runs_a_family_name_with_limit_and_refuses_unknown_tasks(tasks, capsys):
    result = zoo_lm_eval.main(
        ["llama:tiny", "--tasks", "zoo_choice", "--include-path", str(tasks), "--limit", "2", "--max-length", "8"]
    )
    assert len(result["results"]) == 1 and 0 <= result["results"]["zoo_choice"]["acc,none"] <= 1
    with pytest.raises(SystemExit, match="unknown task nope"):
        zoo_lm_eval.main(["llama:tiny", "--tasks", "zoo_choice,nope", "--include-path", str(tasks)])
    with pytest.raises(SystemExit, match="--log-samples writes files"):
        zoo_lm_eval.main(["llama:tiny", "--tasks", "zoo_choice", "--log-samples"])


def test_the_task_index_is_built_again_only_when_the_included_files_change(tmp_path, monkeypatch):
    built = []

    class Manager:  # stands in for lm-eval's TaskManager, whose build reads every task file
        def __init__(self, include_path=None):
            built.append(include_path)

    monkeypatch.setattr(zoo_lm_eval, "import_lm_eval", lambda: (None, None, None, Manager))
    zoo_lm_eval._task_manager.cache_clear()
    task = tmp_path / "mine.yaml"
    task.write_text("task: mine\n")
    first = zoo_lm_eval.task_manager(str(tmp_path))
    assert zoo_lm_eval.task_manager(str(tmp_path)) is first and len(built) == 1
    os.utime(task, ns=(0, task.stat().st_mtime_ns + 10**9))  # the file changed
    assert zoo_lm_eval.task_manager(str(tmp_path)) is not first and len(built) == 2
    (tmp_path / "other.yaml").write_text("task: other\n")  # a file added
    zoo_lm_eval.task_manager(str(tmp_path))
    assert len(built) == 3
    zoo_lm_eval._task_manager.cache_clear()
