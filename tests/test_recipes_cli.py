"""Every mistake a user can make on the recipes' and the planner's command lines is one line on
stderr (the bad value, why, what to do) and a nonzero exit, before anything is built or printed;
``--help`` lists every flag a recipe takes.

The cases run in this process (each fails before a model is built, so nothing compiles); a few
run as real commands too. Failures that need a trained run (corrupt checkpoints, a NaN stop) are
in test_recipes.py."""

import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import checkpointing
from recipes import evaluate, finetune_hf, generate, lm_eval, train_lm
from recipes._lm import cli, data, files
from recipes._lm import flags as run_flags
from recipes._lm import run as run_module
from recipes._lm.run_setup import lr_schedule
from transforms.plan import __main__ as plan_cli
from transforms.plan.__main__ import main as plan_main

ROOT = pathlib.Path(__file__).parents[1]
HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A text directory, a run directory whose checkpoint holds the flags of a 6-step run (and a
    stand-in state: nothing here reads it), a Hugging Face directory without weights or tokenizer,
    and one of an unsupported model type."""
    root = tmp_path_factory.mktemp("cli")
    text = root / "text"
    text.mkdir()
    (text / "a.txt").write_text("def main():\n    return 0\n" * 200)
    run = root / "run"
    flags = ["--data", str(text), "--steps", "6", "--batch", "8", "--seq", "32", "--warmup", "2", "--out", str(run)]
    saved = vars(run_flags.parse(flags))
    with checkpointing.Checkpointer(run / "checkpoints", async_save=False) as ckpt:
        ckpt.save(6, {"w": jnp.zeros(4)}, metadata={"args": saved, "step": 6})
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(HF_CONFIG))
    bert = root / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    return {"text": str(text), "run": str(run), "hf": str(hf), "bert": str(bert), "root": root}


def cases(p):
    """``(main, argv, what the line says)``: at least 40 mistakes, across the four command lines."""
    new = ["--data", p["text"], "--steps", "6", "--batch", "4", "--seq", "16", "--out", str(p["root"] / "new")]
    run, hf, nowhere = p["run"], p["hf"], str(p["root"] / "nowhere")
    t = [
        (["--steps", "0"], "--steps 0: must be at least 1"),
        (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
        (["--batch", "0"], "--batch 0: must be at least 1"),
        (["--seq", "0"], "--seq 0: must be at least 1"),
        (["--accum", "3"], "--batch 4 does not split into --accum 3 micro-batches"),
        (["--lr", "-1"], "--lr -1.0: must be a finite number above 0"),
        (["--lr", "0"], "--lr 0.0: must be a finite number above 0"),
        (["--lr", "nan"], "--lr nan: must be a finite number above 0"),
        (["--warmup", "-1"], "--warmup -1: must be at least 0"),
        (["--clip", "0"], "--clip 0.0: must be a finite number above 0"),
        (["--moments", "float16"], "argument --moments: invalid choice: 'float16' (choose from 'float32', 'bfloat16'"),
        (["--weight-decay", "-0.1"], "--weight-decay -0.1: must be at least 0"),
        (["--compute-dtype", "float7"], "--compute-dtype float7: choose one of float32, bfloat16, float16"),
        (["--param-dtype", "int8"], "--param-dtype int8: choose one of"),
        (["--schedule", "step"], "argument --schedule: invalid choice: 'step'"),
        (["--offload", "weights"], "--offload weights: unknown weights; choose some of params"),
        (["--offload", "activations", "--activations", "nosuchname"], "--activations nosuchname: llama:tiny names no"),
        (["--plan", "nosuchgpu"], "--plan nosuchgpu: unknown device profile 'nosuchgpu'"),
        (["--plan", "auto"], "--plan auto: device='auto': JAX runs on the CPU (no accelerator)"),
        (["--plan", "h100", "--offload", "params"], "give either --plan or --offload"),
        (["--prefetch"], "--prefetch needs --offload params"),
        (["--mesh", "fsdp=3"], "--mesh fsdp=3 has 3 devices but there are 8"),
        (["--mesh", "bogus"], "--mesh: bad entry 'bogus'"),
        (["--model", "llama:nosuch"], "--model llama:nosuch: unknown model"),
        (["--model", "gpt2:tiny", "--seq", "100000"], "--seq 100000 is longer than the"),
        (["--data", nowhere], "is neither a file nor a directory"),
        (["--data-bytes", "0"], "--data-bytes 0: must be at least 1"),
        (["--data-dtype", "uint8"], "--data-dtype uint8: choose one of uint16, uint32"),
        (["--data-field", "body"], "--data-field body: --data " + p["text"] + " holds plain text files only"),
        (["--train-on", "some"], "argument --train-on: invalid choice: 'some' (choose from 'assistant', 'all')"),
        (["--tracker", "tensorboard,mlflow"], "--tracker tensorboard,mlflow: unknown mlflow; choose some of jsonl,"),
        (["--lora-rank", "-1"], "--lora-rank -1: must be at least 0"),
        (["--lora-rank", "2", "--lora-dropout", "1.5"], "--lora-dropout 1.5: must be in [0, 1)"),
        (["--lora-rank", "2", "--lora-alpha", "0"], "--lora-alpha 0.0: must be a finite number above 0"),
        (["--lora-rank", "2", "--lora-targets", "nosuch"], "--lora-targets nosuch: lora: no projection named"),
        (["--quantize", "nf4"], "--quantize nf4 needs --lora-rank"),
        (["--save-every", "-1"], "--save-every -1: must be at least 0"),
        (["--keep", "0"], "--keep 0: must be at least 1"),
        (["--stop-after", "0"], "--stop-after 0: must be at least 1"),
        (["--num-processes", "2"], "--num-processes/--process-id need --coordinator"),
        (["--nosuchflag"], "unrecognized arguments: --nosuchflag"),
    ]
    table = [(train_lm.main, [*new, *argv], what) for argv, what in t]
    table.append((train_lm.main, [*new, "--out", run], f"--out {run} already holds checkpoints"))
    resumed = [
        (["--resume", nowhere], "no checkpoints directory at"),
        (["--resume", run, "--seq", "64"], "--seq 64: a resumed run keeps its --seq (32): the batch of each step"),
        (["--resume", run, "--model", "gpt2:tiny"], "--model gpt2:tiny: a resumed run keeps its --model (llama:tiny)"),
        (
            ["--resume", run, "--offload", "params"],
            "--offload params: a resumed run keeps its --offload (none): where its state",
        ),
        (["--resume", run, "--mesh", "fsdp=8"], "--mesh fsdp=8: a resumed run keeps its --mesh (none)"),
        (
            ["--resume", run, "--moments", "float8"],
            "--moments float8: a resumed run keeps its --moments (float32): the checkpoint holds the optimizer's",
        ),
        (["--resume", run, "--steps", "3"], "--steps 3: the run in"),
        (["--resume", run, "--out", nowhere], "it writes to its own directory"),
        (["--resume", run, "--lr", "-1"], "--lr -1.0: must be a finite number above 0"),
    ]
    table += [(train_lm.main, argv, what) for argv, what in resumed]
    table += [
        (finetune_hf.main, [p["text"]], "is not a Hugging Face checkpoint directory (no config.json)"),
        (finetune_hf.main, [hf, "--export-dtype", "float7"], "--export-dtype float7: choose one of"),
        (finetune_hf.main, [hf, "--export-merged", nowhere], "needs --lora-rank (a LoRA run)"),
        (finetune_hf.main, [hf, "--model", "llama:tiny"], "unrecognized arguments: --model"),
        (finetune_hf.main, [hf, "--seq", "200000"], "--seq 200000 is longer than the 128 positions"),
        (finetune_hf.main, [p["bert"]], "model_type 'bert' is not supported"),
        (finetune_hf.main, [hf, "--lr", "0"], "--lr 0.0: must be a finite number above 0"),
        (finetune_hf.main, [], "the following arguments are required: checkpoint"),
        (evaluate.main, [nowhere], "is neither a train_lm run directory"),
        (evaluate.main, [run, "--step", "999"], "--step 999: " + run + " has no complete checkpoint at step 999"),
        (evaluate.main, [run, "--seq", "64"], "--seq: " + run + " is a train_lm run, which brings its own flags"),
        (evaluate.main, [run, "--samples", "-1"], "--samples -1: must be at least 0"),
        (evaluate.main, [run, "--tokens", "0"], "--tokens 0: must be at least 1"),
        (evaluate.main, [run, "--eval-batches", "0"], "--eval-batches 0: must be at least 1"),
        (evaluate.main, [hf, "--step", "3"], "is a Hugging Face directory, which has no steps"),
        (evaluate.main, [hf, "--compute-dtype", "float7"], "--compute-dtype float7: choose one of"),
    ]
    gen = [
        (["--model", run, "--prompt", "x", "--step", "999"], "--step 999: " + run + " has no complete checkpoint"),
        (["--model", nowhere, "--prompt", "x"], "neither a Hugging Face checkpoint (config.json) nor a train_lm run"),
        (["--model", run, "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
        (["--model", run, "--prompt", "x", "--temperature", "-1"], "--temperature -1.0: must be 0 (greedy) or above"),
        (["--model", run, "--prompt", "x", "--top-k", "0"], "--top-k 0: must be at least 1"),
        (["--model", run, "--prompt", "x", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
        (["--model", run, "--prompt", ""], "--prompt '': give some text to continue"),
        (["--model", hf, "--prompt", "x", "--dtype", "float7"], "--dtype float7: choose one of"),
        (["--model", run, "--prompt", "x", "--dtype", "bfloat16"], "a run keeps its own dtype"),
        (["--model", hf, "--prompt", "x"], "no tokenizer.json to encode the prompt"),
        (["--model", run, "--prompt", "x", "--cache-memory-kind", "nowhere"], "invalid choice: 'nowhere'"),
        (["--model", run], "the following arguments are required: --prompt"),
    ]
    table += [(generate.main, argv, what) for argv, what in gen]
    plan = [
        (["--model", "nosuch:x", "--batch", "1", "--seq", "8"], "unknown model 'nosuch:x'"),
        (["llama:tiny", "--batch", "1", "--seq", "8", "--device", "nosuchgpu"], "unknown device profile"),
        (["llama:tiny", "--batch", "0", "--seq", "8"], "batch must be a positive int, got 0"),
        (["llama:tiny", "--batch", "1", "--seq", "8", "--margin", "2"], "margin must be in [0, 1), got 2.0"),
        (["llama:tiny", "--batch", "1", "--seq", "8", "--device", "custom"], "--device custom needs --memory-gb"),
        (["llama:tiny", "--batch", "1", "--generate"], "--generate needs --context"),
        (["llama:tiny", "--batch", "1", "--seq", "8", "--compute-dtype", "float7"], "compute_dtype must be one of"),
        (["--batch", "1", "--seq", "8"], "give the model once"),
        (["llama:tiny", "--batch", "x", "--seq", "8"], "argument --batch: invalid int value: 'x'"),
    ]
    table += [(plan_main, argv, what) for argv, what in plan]
    return table


def run_main(main, argv, capfd) -> tuple[object, str, str]:
    """``(exit status, stdout, stderr)`` of ``main(argv)`` as the command line would see them (a
    `SystemExit` with a message prints it and exits 1). Any other exception propagates: a traceback."""
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    out, err = capfd.readouterr()
    if isinstance(status, str):
        status, err = 1, err + status + "\n"
    return status, out, err


def test_every_user_error_is_one_line_and_a_nonzero_exit_before_any_output(paths, capfd):
    table = cases(paths)
    assert len(table) >= 40
    capfd.readouterr()
    for main, argv, what in table:
        status, out, err = run_main(main, argv, capfd)
        where = f"{main.__module__} {argv}"
        assert status not in (0, None), where
        assert out == "", (where, out)  # argument checks run before any output
        assert err.count("\n") == 1 and err.endswith("\n"), (where, err)
        assert what in err, (where, err)
    assert not (paths["root"] / "new").exists()  # nothing was written either


def test_as_commands_they_are_one_line_too(paths):
    run, new = paths["run"], ["--data", paths["text"], "--out", str(paths["root"] / "cmd")]
    commands = [
        ["recipes.train_lm", *new, "--offload", "activations", "--activations", "nosuchname"],
        ["recipes.generate", "--model", run, "--prompt", "x", "--step", "999"],
        ["transforms.plan", "llama:tiny", "--batch", "1", "--seq", "8", "--device", "nosuchgpu"],
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, "-m", *c], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    for command, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode != 0 and out == "", (command, out, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (command, err)


def test_an_unexpected_error_keeps_its_traceback(paths, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(run_module, "open_corpus", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        train_lm.main(["--data", paths["text"], "--out", str(paths["root"] / "bug")])


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_help_lists_every_flag_a_recipe_takes(capsys):
    train = _options(train_lm.build_parser())
    for main, expected in [
        (train_lm.main, train),
        (finetune_hf.main, (train - {"--model"}) | {"--export", "--export-merged", "--export-dtype"}),
        (evaluate.main, {"--step", "--samples", "--tokens", "--prompt", "--json", "--eval-batches"}),
        (generate.main, _options(generate.build_parser())),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0
        shown = capsys.readouterr().out
        missing = sorted(o for o in expected if o not in shown)
        assert not missing, (main.__module__, missing)
    with pytest.raises(SystemExit):
        evaluate.main(["--help"])
    shown = capsys.readouterr().out
    assert all(f"--{name.replace('_', '-')}" in shown for name in evaluate.HF_FLAGS)


def test_every_flag_is_either_changeable_on_resume_kept_or_of_one_invocation():
    kept = [name for names in run_flags.KEPT.values() for name in names]
    groups = [*run_flags.RUN_CONTROL, *run_flags.CHANGEABLE, *kept]
    flags = [a.dest for a in train_lm.build_parser()._actions if a.dest != "help"]
    assert sorted(groups) == sorted(flags)  # each flag in exactly one group


def test_a_run_shorter_than_its_warmup_is_warned_about(paths):
    flags = ["--data", paths["text"], "--steps", "5", "--warmup", "40"]
    parsed = run_flags.parse_run(flags)
    assert parsed.changes == [] and len(parsed.warnings) == 1
    assert parsed.warnings[0].startswith("--steps 5 is shorter than --warmup 40: the warmup is cut to 4 steps")
    assert run_flags.parse_run([*flags, "--warmup", "5"]).warnings == []


@pytest.mark.parametrize("kind", run_flags.SCHEDULES)
def test_each_schedule_warms_up_to_lr_then_decays_to_a_tenth_or_stays(kind):
    schedule = lr_schedule(lr=1.0, warmup=4, steps=20, kind=kind)
    rates = [float(schedule(count)) for count in range(21)]
    assert rates[0] == 0.0 and rates[2] == pytest.approx(0.5) and rates[4] == pytest.approx(1.0)
    assert rates[20] == pytest.approx(1.0 if kind == "constant" else 0.1)
    assert all(a >= b for a, b in itertools.pairwise(rates[4:]))  # no rise after the warmup
    if kind == "linear":
        assert rates[12] == pytest.approx(0.55)  # halfway through the decay
    no_warmup = lr_schedule(lr=1.0, warmup=0, steps=20, kind=kind)
    assert float(no_warmup(0)) == pytest.approx(1.0)


# --- the second pass: bad bytes, output paths, ranges, sizes, live runs, exports -------------------

WORDS = ["def", "main", "return", "x", "hi", "ok", "user", "assistant", "<eos>", "<|user|>", "<|assistant|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _hf_with_tokenizer(directory: pathlib.Path, *, config: dict | None = None) -> pathlib.Path:
    """A Hugging Face directory (no weights) with a small word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config or HF_CONFIG))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *WORDS])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def bad(paths):
    """Files a user may hand the recipes that are broken or wrong in some way, and a live run."""
    root = paths["root"] / "bad"
    root.mkdir()
    out = {}
    out["latin1"] = root / "latin1.jsonl"
    out["latin1"].write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    out["nested"] = root / "nested.jsonl"
    out["nested"].write_text('{"text": "fine"}\n{"text": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    out["parquet"] = root / "broken.parquet"
    out["parquet"].write_bytes(b"PAR1" + bytes(range(256)) * 8)
    out["bin"] = root / "tokens.bin"
    (np.arange(50_000) % 300).astype(np.uint16).tofile(out["bin"])
    lines = [json.dumps({"messages": [{"role": "user", "content": "hi " * 20}]}) for _ in range(60)]
    out["no_assistant"] = root / "no_assistant.jsonl"
    out["no_assistant"].write_text("\n".join(lines) + "\n")
    out["chat_hf"] = _hf_with_tokenizer(root / "chat_hf")
    out["eos_hf"] = _hf_with_tokenizer(root / "eos_hf", config={**HF_CONFIG, "eos_token_id": 4096})
    (out["eos_hf"] / "tokenizer_config.json").write_text("{}")  # the id then comes from config.json
    out["cut_tok"] = _hf_with_tokenizer(root / "cut_tok")
    text = (out["cut_tok"] / "tokenizer.json").read_text()
    (out["cut_tok"] / "tokenizer.json").write_text(text[: len(text) // 2])
    out["cut_tok_config"] = _hf_with_tokenizer(root / "cut_tok_config")
    (out["cut_tok_config"] / "tokenizer_config.json").write_text('{"chat_template": "{{')
    out["latin1_template"] = _hf_with_tokenizer(root / "latin1_template")
    (out["latin1_template"] / "chat_template.jinja").write_bytes(b"caf\xe9 {{ messages }}")
    chat = root / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    )
    out["chat"] = chat
    # a run whose saved flags were edited by hand
    for name, edit in (("edited_steps", {"steps": "six"}), ("edited_offload", {"offload": 42})):
        saved = {**vars(run_flags.parse(["--data", paths["text"], "--out", str(root / name)])), **edit}
        with checkpointing.Checkpointer(root / name / "checkpoints", async_save=False) as ckpt:
            ckpt.save(6, {"w": jnp.zeros(4)}, metadata={"args": saved, "step": 6})
    out["edited_steps"], out["edited_offload"] = root / "edited_steps", root / "edited_offload"
    # a file where a directory goes, a directory with something in it
    out["file"] = root / "a_file"
    out["file"].write_text("x")
    out["orphan"] = root / "orphan"  # a run that stopped before its first checkpoint
    out["orphan"].mkdir()
    (out["orphan"] / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    out["full"] = root / "full"
    out["full"].mkdir()
    (out["full"] / "keep.txt").write_text("precious")
    # two live runs: one resumable, one a fresh directory in use
    live = root / "live"
    shutil.copytree(paths["run"], live)
    busy = root / "busy"
    busy.mkdir()
    locks = [files.RunLock(live, what="test").acquire(), files.RunLock(busy, what="test").acquire()]
    out["live"], out["busy"] = live, busy
    yield {k: str(v) for k, v in out.items()}
    for lock in locks:
        lock.release()


def more_cases(p, b):
    """``(id, main, argv, what the line says)``: the second pass's mistakes, each one line before any
    work: bad bytes, unwritable outputs, values out of range, sizes beyond this machine, a live run
    directory, exports that would overwrite what the run reads."""
    new = ["--data", p["text"], "--steps", "6", "--batch", "4", "--seq", "16", "--out", str(p["root"] / "new")]
    run, hf, root = p["run"], p["hf"], p["root"]
    t = [
        ("seed-negative", ["--seed", "-1"], "--seed -1: must be from 0 to 4,294,967,295"),
        ("seed-huge", ["--seed", str(2**40)], f"--seed {2**40}: must be from 0 to 4,294,967,295"),
        ("offload-both", ["--offload", "opt_state,opt_state_stream"], "opt_state and opt_state_stream are 2 ways"),
        ("activations-empty", ["--offload", "activations", "--activations", ","], "--activations ',': give a preset"),
        ("out-is-file", ["--out", b["file"]], f"--out {b['file']}: is a file, not a directory"),
        ("out-under-file", ["--out", b["file"] + "/run"], "is a file, so nothing can go under it"),
        ("out-orphan", ["--out", b["orphan"]], "already holds another run's metrics.jsonl (and no checkpoint"),
        ("out-in-data", ["--out", p["text"] + "/run"], "it lies in --data"),
        ("out-live", ["--out", b["busy"]], f"the run directory {b['busy']} is in use by pid {os.getpid()}"),
        ("batch-absurd", ["--batch", "1000000000"], "--batch 1000000000 --seq 16: one step needs about"),
        ("eval-batches-absurd", ["--eval-batches", "1000000"], "--eval-batches 1000000: 1,000,000 batches of 4 x 16"),
        ("lora-rank-absurd", ["--lora-rank", "100000"], "--lora-rank 100000: above the width of the narrowest"),
        ("coordinator", ["--coordinator", "nohost"], "--coordinator nohost: give HOST:PORT"),
        ("coordinator-alone", ["--coordinator", "127.0.0.1:12399"], "the multi-process runtime did not start"),
        ("processes-zero", ["--coordinator", "h:1", "--num-processes", "0"], "--num-processes 0: must be at least 1"),
        (
            "process-id",
            ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
            "--process-id 2: must be",
        ),
        ("mesh-twice", ["--mesh", "data=2,data=4"], "the axis data is given twice"),
        ("mesh-split", ["--mesh", "data=8"], "--mesh data=8: a batch's 4 rows do not split evenly over its 8"),
        ("mesh-split-accum", ["--mesh", "fsdp=8", "--batch", "16", "--accum", "4"], "each micro-batch's 4 rows"),
        ("jsonl-latin1", ["--data", b["latin1"]], "line 2 is not UTF-8 text"),
        ("jsonl-nested", ["--data", b["nested"]], "line 2 nests its JSON too deeply"),
        ("parquet-broken", ["--data", b["parquet"]], "datasets cannot read it"),
        ("bin-ids", ["--data", b["bin"], "--data-dtype", "uint16"], "token id 299 is outside the tokenizer's vocab"),
        ("chat-bytes", ["--data", b["chat"]], "holds conversations ('messages')"),
    ]
    table = [(name, train_lm.main, [*new, *argv], what) for name, argv, what in t]
    table += [
        ("resume-live", train_lm.main, ["--resume", b["live"]], f"--resume {b['live']}: the run directory"),
        ("resume-edited", train_lm.main, ["--resume", b["edited_steps"]], "--steps holds 'six', not an integer"),
        ("resume-edited-text", train_lm.main, ["--resume", b["edited_offload"]], "--offload holds 42, not text"),
    ]
    chat, data = [b["chat_hf"], "--data", b["no_assistant"], "--seq", "16", "--batch", "4"], ["--data", p["text"]]
    ft = [
        ("tokenizer-cut", [b["cut_tok"], *data], "tokenizer.json does not load"),
        ("tokenizer-config-cut", [b["cut_tok_config"], "--data", b["chat"]], "tokenizer_config.json is not readable"),
        ("template-latin1", [b["latin1_template"], "--data", b["chat"]], "chat_template.jinja is not UTF-8 text"),
        ("eos-beyond", [b["eos_hf"], *data], "end-of-sequence token id 4096 (eos_token_id) is outside"),
        ("chat-no-assistant", chat, "holds no assistant tokens, so its loss would cover nothing"),
        ("export-onto-source", [hf, *data, "--export", hf], f"--export {hf}: it overlaps the checkpoint"),
        ("export-around-source", [hf, *data, "--export", str(root), "--overwrite"], "it overlaps the checkpoint"),
        ("export-into-source", [hf, *data, "--export", hf + "/out"], "it overlaps the checkpoint"),
        ("export-onto-data", [hf, *data, "--export", p["text"]], "it overlaps --data"),
        ("export-not-empty", [hf, *data, "--export", b["full"]], "the directory is not empty; give --overwrite"),
        ("export-file", [hf, *data, "--export", b["file"]], "is a file, not a directory"),
        ("export-run-dir", [hf, *data, "--out", str(root / "ft"), "--export", str(root / "ft")], "the run directory"),
        (
            "exports-overlap",
            [hf, *data, "--lora-rank", "2", "--export", str(root / "e"), "--export-merged", str(root / "e")],
            "the two exports overlap",
        ),
    ]
    table += [(name, finetune_hf.main, argv, what) for name, argv, what in ft]
    ev = [
        ("json-dir", [run, "--json", str(root)], f"--json {root!s}"),
        ("json-under-file", [run, "--json", b["file"] + "/r.json"], "is a file, so nothing can go under it"),
        ("json-in-source", [hf, "--json", hf + "/config.json"], "the file is part of"),
        ("tokens-absurd", [run, "--tokens", "100000"], "--tokens 100000: must be at most 127"),
        ("samples-absurd", [run, "--samples", "1000000000"], "generating 1,000,000,000 sequences"),
        ("eval-batches-split", [run, "--eval-batches", "1000000"], "would read the"),
    ]
    table += [(f"evaluate-{name}", evaluate.main, argv, what) for name, argv, what in ev]
    gen = [
        ("max-new-tokens", ["--max-new-tokens", "100000"], "--max-new-tokens 100000: must be at most 127"),
        ("seed", ["--seed", "-5"], "--seed -5: must be from 0"),
        ("top-k", ["--temperature", "1", "--top-k", "1000"], "--top-k 1000: must be at most 256"),
    ]
    table += [(f"generate-{n}", generate.main, ["--model", run, "--prompt", "x", *a], w) for n, a, w in gen]
    table.append(("generate-tokenizer-cut", generate.main, ["--model", b["cut_tok"], "--prompt", "x"], "does not load"))
    lm = [
        ("fewshot", ["--num-fewshot", "-2"], "--num-fewshot -2: must be at least 0"),
        ("limit-fraction", ["--limit", "1.5"], "--limit 1.5: give a whole number"),
        ("output-file", ["--output-path", b["file"]], "is a file, not a directory"),
        ("step-preset", ["--step", "3"], "--step 3: llama:tiny is not a train_lm run directory"),
        ("max-gen-toks", ["--max-gen-toks", "1000"], "--max-gen-toks 1000: must be at most 127"),
        ("max-length", ["--max-length", "100000"], "--max-length 100000: must be at most 128"),
        ("batch-size", ["--batch-size", "1000000000"], "--batch-size 1000000000: generating"),
    ]
    table += [(f"lm-eval-{n}", lm_eval.main, ["llama:tiny", "--tasks", "t", *a], w) for n, a, w in lm]
    table.append(
        ("lm-eval-dtype-run", lm_eval.main, [run, "--tasks", "t", "--dtype", "bfloat16"], "keeps its own dtype")
    )
    plan = [
        ("png-dir", ["--png", str(root)], "is a directory"),
        ("json-under-file", ["--json", b["file"] + "/p.json"], "is a file, so nothing can go under it"),
        ("png-generate", ["--generate", "--context", "64", "--png", str(root / "p.png")], "has no chart"),
    ]
    table += [(f"plan-{n}", plan_main, ["llama:tiny", "--batch", "1", "--seq", "8", *a], w) for n, a, w in plan]
    return table


MORE = [
    "seed-negative", "seed-huge", "offload-both", "activations-empty", "out-is-file", "out-under-file",
    "out-orphan", "out-in-data", "out-live", "batch-absurd", "eval-batches-absurd", "lora-rank-absurd",
    "coordinator", "coordinator-alone", "processes-zero", "process-id", "mesh-twice", "mesh-split",
    "mesh-split-accum", "jsonl-latin1", "jsonl-nested", "parquet-broken", "bin-ids", "chat-bytes", "resume-live",
    "resume-edited", "resume-edited-text", "tokenizer-cut", "tokenizer-config-cut", "template-latin1", "eos-beyond",
    "chat-no-assistant", "export-onto-source", "export-around-source", "export-into-source", "export-onto-data",
    "export-not-empty", "export-file", "export-run-dir", "exports-overlap", "evaluate-json-dir",
    "evaluate-json-under-file", "evaluate-json-in-source", "evaluate-tokens-absurd", "evaluate-samples-absurd",
    "evaluate-eval-batches-split", "generate-max-new-tokens", "generate-seed", "generate-top-k",
    "generate-tokenizer-cut", "lm-eval-fewshot", "lm-eval-limit-fraction", "lm-eval-output-file",
    "lm-eval-step-preset", "lm-eval-max-gen-toks", "lm-eval-max-length", "lm-eval-batch-size", "lm-eval-dtype-run",
    "plan-png-dir", "plan-json-under-file", "plan-png-generate",
]  # fmt: skip


def test_the_second_table_names_each_case_once(paths, bad):
    assert [name for name, *_ in more_cases(paths, bad)] == MORE and len(set(MORE)) == len(MORE) >= 40


@pytest.mark.parametrize("name", MORE)
def test_each_mistake_of_the_second_pass_is_one_line_before_any_work(name, paths, bad, capfd):
    main, argv, what = {n: rest for n, *rest in more_cases(paths, bad)}[name]
    before = sorted(p.relative_to(paths["root"]) for p in paths["root"].rglob("*"))
    capfd.readouterr()
    status, out, err = run_main(main, argv, capfd)
    assert status not in (0, None), err
    assert out == "", out  # nothing printed before the check
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert what in err, err
    assert "Traceback" not in err
    after = sorted(p.relative_to(paths["root"]) for p in paths["root"].rglob("*"))
    assert after == before  # nothing written, nothing removed
    assert (bad_full := pathlib.Path(bad["full"]) / "keep.txt").read_text() == "precious", bad_full


def warning_cases(p, b):
    """``(id, call, what the one warning says)``: flags that are legal but have no effect with the
    others; ``call()`` runs the recipe's checks (nothing is built or loaded) and returns the warning lines."""
    new = ["--data", p["text"], "--steps", "6", "--batch", "4", "--seq", "16", "--warmup", "2"]
    run, hf = p["run"], p["hf"]

    def train(*argv):
        return lambda: run_flags.parse_run([*new, *argv]).warnings

    def gen(*argv):
        def call():
            full = ["--model", run, "--prompt", "x", *argv]
            return generate.check(
                generate.build_parser().parse_args(full), set(cli.given_flags(generate.build_parser(), full))
            )

        return call

    def ev(*argv):
        def call():
            args = evaluate.build_evaluate_parser().parse_args([run, *argv])
            return evaluate.check_flags(args, cli.given_flags(evaluate.build_evaluate_parser(), [run, *argv]))[1]

        return call

    def ft(*argv):
        def call():
            full = [hf, "--data", p["text"], *argv]
            args = finetune_hf.build_parser().parse_args(full)
            return finetune_hf.check(args, set(cli.given_flags(finetune_hf.build_parser(None), full)))

        return call

    def plan(*argv):
        def call():
            full = ["llama:tiny", "--batch", "1", *argv]
            return plan_cli._no_effect(plan_cli.build_parser().parse_args(full), plan_cli._given(full))

        return call

    def corpus(source, tokenizer, train_on):
        return lambda: data.open_corpus(source, tokenizer(), limit=None, seed=0, train_on=train_on).warnings

    mixed = p["root"] / "mixed_chat.jsonl"
    silent = {"messages": [{"role": "user", "content": "hi " * 30}]}
    spoken = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok " * 30}]}
    mixed.write_text("\n".join(json.dumps(r) for r in [silent, *[spoken] * 30]) + "\n")
    return [
        ("lora-alpha", train("--lora-alpha", "4"), "--lora-alpha has no effect without --lora-rank"),
        ("lora-targets", train("--lora-targets", "q_proj"), "--lora-targets has no effect without --lora-rank"),
        ("lora-dropout", train("--lora-dropout", "0.1"), "--lora-dropout has no effect without --lora-rank"),
        ("base-dtype", train("--base-dtype", "bfloat16"), "--base-dtype has no effect without --lora-rank"),
        ("base-dtype-preset", train("--lora-rank", "2", "--base-dtype", "bfloat16"), "with --model llama:tiny"),
        ("activations", train("--activations", "q_proj"), "--activations q_proj has no effect: --offload does not"),
        ("activations-plan", train("--plan", "h100", "--activations", "q_proj"), "--plan h100 chooses the activation"),
        ("prompt-quiet", train("--quiet-samples", "--prompt", "x"), "--prompt has no effect with --quiet-samples"),
        ("sample-quiet", train("--quiet-samples", "--sample-before"), "--sample-before has no effect with --quiet"),
        ("stop-after", train("--stop-after", "10"), "--stop-after 10 has no effect: the run ends at --steps 6 first"),
        ("generate-top-k", gen("--top-k", "5"), "--top-k has no effect without --temperature above 0"),
        ("generate-top-p", gen("--top-p", "0.9"), "--top-p has no effect without --temperature above 0"),
        ("generate-seed", gen("--seed", "3"), "--seed has no effect without --temperature above 0"),
        ("evaluate-tokens", ev("--samples", "0", "--tokens", "5"), "--tokens has no effect with --samples 0"),
        ("evaluate-prompt", ev("--samples", "0", "--prompt", "x"), "--prompt has no effect with --samples 0"),
        ("export-dtype", ft("--export-dtype", "bfloat16"), "--export-dtype has no effect without --export"),
        (
            "export-dtype-adapter",
            ft("--lora-rank", "2", "--export", str(p["root"] / "adapter"), "--export-dtype", "bfloat16"),
            "--export-dtype has no effect on a LoRA adapter",
        ),
        ("overwrite", ft("--overwrite"), "--overwrite has no effect without --export or --export-merged"),
        ("train-on-text", corpus(p["text"], data.ByteTokenizer, "all"), "--train-on all has no effect"),
        (
            "conversation-silent",
            corpus(str(mixed), lambda: data.HFTokenizer(b["chat_hf"]), "assistant"),
            "1 of 31 conversations have no assistant message",
        ),
        ("plan-custom", plan("--seq", "8", "--memory-gb", "24"), "--memory-gb has no effect with --device h100"),
        ("plan-train-only", plan("--generate", "--context", "64", "--fsdp", "1"), "--fsdp has no effect with --gen"),
        ("plan-seq", plan("--generate", "--context", "64", "--seq", "8"), "--seq 8 has no effect with --generate"),
        ("plan-generate-only", plan("--seq", "8", "--prompt", "4"), "--prompt has no effect without --generate"),
    ]


WARNINGS = [
    "lora-alpha", "lora-targets", "lora-dropout", "base-dtype", "base-dtype-preset", "activations",
    "activations-plan", "prompt-quiet", "sample-quiet", "stop-after", "generate-top-k", "generate-top-p",
    "generate-seed", "evaluate-tokens", "evaluate-prompt", "export-dtype", "export-dtype-adapter", "overwrite",
    "train-on-text", "conversation-silent", "plan-custom", "plan-train-only", "plan-seq", "plan-generate-only",
]  # fmt: skip


@pytest.mark.parametrize("name", WARNINGS)
def test_a_flag_without_effect_is_one_warning_line_and_the_command_goes_on(name, paths, bad, capfd):
    cases = {n: (call, what) for n, call, what in warning_cases(paths, bad)}
    assert list(cases) == WARNINGS
    call, what = cases[name]
    capfd.readouterr()
    lines = call()
    assert len(lines) == 1 and what in lines[0], lines


def test_the_planner_prints_its_warning_and_its_plan(capfd):
    assert plan_main(["llama:tiny", "--batch", "1", "--seq", "8", "--tflops", "100"]) == 0
    out, err = capfd.readouterr()
    assert err == "warning: --tflops has no effect with --device h100 (it describes --device custom)\n"
    assert "llama:tiny" in out and "Notes:" in out


def test_the_same_commands_without_those_flags_warn_of_nothing(paths, bad, capfd):
    new = ["--data", paths["text"], "--steps", "6", "--batch", "4", "--seq", "16", "--warmup", "2"]
    assert run_flags.parse_run(new).warnings == []
    assert run_flags.parse_run([*new, "--lora-rank", "2", "--lora-alpha", "4", "--quiet-samples"]).warnings == []
    args = generate.build_parser().parse_args(["--model", paths["run"], "--prompt", "x", "--temperature", "1"])
    assert generate.check(args, {"top_k", "top_p", "seed"}) == []
    assert data.open_corpus(paths["text"], data.ByteTokenizer(), limit=None, seed=0).warnings == []
    for argv in (["--seq", "8", "--device", "custom", *CUSTOM], ["--generate", "--context", "64", "--prompt", "8"]):
        full = ["llama:tiny", "--batch", "1", *argv]
        assert plan_cli._no_effect(plan_cli.build_parser().parse_args(full), plan_cli._given(full)) == []


CUSTOM = ["--memory-gb", "24", "--link-gb-s", "25", "--tflops", "100"]


def test_the_planner_answers_an_absurd_batch_promptly(capfd):
    import time

    start = time.perf_counter()
    assert plan_main(["llama:8b", "--batch", "1000000000000000", "--seq", "8"]) == 0
    assert time.perf_counter() - start < 30
    out = capfd.readouterr().out
    assert "nothing fits" in out and "would fit: batch=" in out


def test_an_output_path_under_new_directories_is_written_after_the_check(tmp_path, capfd):
    target = tmp_path / "new" / "deeper" / "plan.json"
    assert plan_main(["llama:tiny", "--batch", "1", "--seq", "8", "--json", str(target)]) == 0
    assert json.loads(target.read_text())["batch"] == 1
    files.write_text(tmp_path / "other" / "r.json", "{}")
    assert (tmp_path / "other" / "r.json").read_text() == "{}"
