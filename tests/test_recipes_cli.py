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
import subprocess
import sys

import jax.numpy as jnp
import pytest

import checkpointing
from recipes import evaluate, finetune_hf, generate, train_lm
from recipes._lm import flags as run_flags
from recipes._lm import run as run_module
from recipes._lm.run_setup import lr_schedule
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
        (["--weight-decay", "-0.1"], "--weight-decay -0.1: must be at least 0"),
        (["--compute-dtype", "float7"], "--compute-dtype float7: choose one of float32, bfloat16, float16"),
        (["--param-dtype", "int8"], "--param-dtype int8: choose one of"),
        (["--schedule", "step"], "argument --schedule: invalid choice: 'step'"),
        (["--offload", "weights"], "--offload weights: unknown weights; choose some of params"),
        (["--offload", "activations", "--activations", "nosuchname"], "--activations nosuchname: llama:tiny names no"),
        (["--plan", "nosuchgpu"], "--plan nosuchgpu: unknown device profile 'nosuchgpu'"),
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
