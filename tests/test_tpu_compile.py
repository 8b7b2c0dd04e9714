"""benchmarks/tpu_compile.py: a train step compiled for a described chip, its memory and the
whole stacks it moves between host and device (the path is exercised here for the CPU)."""

import importlib.util
import json

import pytest

from benchmarks import tpu_compile


def test_the_cpu_target_compiles_a_configuration_and_reports_its_memory(tmp_path, capsys):
    argv = ["--target", "cpu", "--model", "llama:tiny", "--batch", "2", "--seq", "16", "--configs", "opt_state_stream"]
    assert tpu_compile.main([*argv, "--out", str(tmp_path), "--save-hlo", str(tmp_path / "hlo")]) == 0
    assert "HloModule" in (tmp_path / "hlo" / "opt_state_stream.hlo.txt").read_text()
    (row,) = json.loads((tmp_path / "tpu_compile_cpu.json").read_text())["rows"]
    assert row["compiled"] and row["config"] == "opt_state_stream"
    assert row["device"]["argument"] > 0 and row["device"]["alias"] > 0  # the state is donated and aliased
    assert row["whole_stack_copies"] == 0  # the CPU has one memory: nothing crosses
    assert "| opt_state_stream | yes" in capsys.readouterr().out


def test_whole_stack_copies_counts_stacks_crossing_between_host_and_device_or_copied_on_the_host():
    hlo = "\n".join(
        [
            "  %a = (f32[12,768,256]{2,1,0:T(8,128)S(5)}, f32[12,768,256]{2,1,0:T(8,128)}, u32[]) copy-start(%x)",
            "  %b = (f32[12,768]{1,0:T(8,128)}, f32[12,768]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) copy-start(%y)",
            "  %c = (f32[768,256]{1,0:T(8,128)S(5)}, f32[768,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%z)",
            "  %d = (f32[12,768]{1,0:T(8,128)S(1)}, f32[12,768]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%w)",
            "  %e = ((f32[12,768]{1,0:T(8,128)S(5)}), f32[12,768]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) custom-call-start("
            '%v), async_execution_thread="host", custom_call_target="HostExecute"',
            "  %f = ((f32[768]{0:T(1024)S(5)}), f32[768]{0:T(1024)S(5)}, u32[]{:S(2)}) custom-call-start("
            '%u), async_execution_thread="host", custom_call_target="HostExecute"',
        ]
    )
    # a and b cross (either way); c is one layer; d moves within the device (S(1)); e is a stack
    # copied within host memory by the host, f a vector.
    assert tpu_compile.whole_stack_copies(hlo, 12) == 3
    assert tpu_compile.whole_stack_copies(hlo, 16) == 0


def test_bad_configurations_and_a_missing_compiler_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        tpu_compile.main(["--configs", "nonsense"])
    assert "valid: none, all_three, act_block_input" in capsys.readouterr().err
    if importlib.util.find_spec("libtpu") is None:
        with pytest.raises(SystemExit):
            tpu_compile.main(["--configs", "none"])
        assert "no TPU compiler: pip install" in capsys.readouterr().err


def test_host_arguments_reach_the_library_with_a_host_type(monkeypatch):
    """An abstract argument with a pinned_host sharding traces with a device-space type, unlike a
    host array on the chip; the library would then not move it to the device before its math, and
    XLA:TPU runs that math on the host CPU (HostExecute), which the chip's own program does not."""
    import jax

    import transforms._opt_stream as streamed

    seen = []
    real = streamed.on_host
    monkeypatch.setattr(streamed, "on_host", lambda x: seen.append(real(x)) or seen[-1])
    model, state, step = tpu_compile.build("llama:tiny", "opt_state_stream")
    tpu_compile.lowered_for(jax.devices("cpu")[0], model, state, step, 2, 16)
    stacked = [x for x in jax.tree.leaves(state.stacked) if x.sharding.memory_kind == "pinned_host"]
    assert stacked and sum(seen) >= len(stacked)  # each stacked host leaf is read as host (0 untyped)


def test_weights_stacks_offloads_only_the_stacks_weights():
    """``--weights stacks``: a configuration that offloads weights keeps the embedding, head and
    final norm on the device (this libtpu refuses a host embedding updated by the streamed
    optimizer), the stack's transforms (prefetch, activation policy) as the configuration says."""
    import jax

    model, _, _ = tpu_compile.build("llama:tiny", "all_three_defer", weights="stacks")
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
    assert kinds(model.stack) == {"pinned_host"} and model.stack.prefetch and model.stack.remat is not None
    assert kinds((model.embed, model.norm, model.lm_head)) == {"device"}
    whole, _, _ = tpu_compile.build("llama:tiny", "all_three_defer")
    assert kinds(whole.embed) == {"pinned_host"}


def test_capacity_configurations_with_stated_transforms_compile_and_planned_ones_do_not():
    from benchmarks.accelerator_check.configs import config_table

    table = {c.name: c for c in config_table()}
    stated = [n for n, c in table.items() if c.capacity and c.opt != "device"]
    planned = [n for n, c in table.items() if c.capacity and c.opt == "device"]
    assert "capacity_defer_f8_projections" in stated and {"capacity", "capacity_bf16"} <= set(planned)
    assert set(stated) <= set(tpu_compile.CONFIGS)
    assert not set(planned) & set(tpu_compile.CONFIGS)
    assert not any(table[n].capped for n in tpu_compile.CONFIGS)


@pytest.mark.parametrize(
    ("state", "stated"),
    [
        ("bfloat16", "capacity_defer_bf16_block_input_bf16grads_stacks"),
        ("float8", "capacity_defer_f8_block_input_bf16grads_stacks"),
    ],
)
def test_the_stated_capacity_configurations_are_the_planners_plans_for_a_v5e(state, stated):
    """``capacity_bf16`` and ``capacity_f8`` run the planner's plan; these configurations state its
    transforms so that tpu_compile can compile them: they must stay the plan."""
    import optax

    import transforms
    from benchmarks.accelerator_check.configs import config_table, make_config

    conf = {c.name: c for c in config_table()}[stated]
    opt = transforms.compact_state(optax.adamw(1e-4), state)
    cfg = make_config("llama:1b", seq=2048)
    plan = transforms.plan(cfg, batch=8, seq=2048, device="tpu-v5e", optimizer=opt, clip_norm=1.0)
    assert plan.fits and plan.candidate.opt_state == "defer:stacks" and not plan.candidate.params
    assert plan.activation_policy == {conf.activations: "offload"} and plan.pending_dtype == conf.pending
    assert (conf.opt, conf.where, conf.state, conf.params) == ("defer", "stacks", state, False)


def test_a_tpu_target_compiles_the_splash_kernel_where_the_chip_would_run_it(monkeypatch):
    """The chip's train step runs the Pallas kernel for long sequences; compiled here for a TPU, the
    model takes it too (not the CPU backend's choice), built for the TPU rather than interpreted;
    the CPU target and short sequences keep the model's own attention, and the options default to
    the train step's for a TPU."""
    import argparse

    import zoo
    from transforms._xla_options import TPU_HOST_TRANSFER_OPTIONS

    monkeypatch.setitem(zoo.nn.SPLASH_SETTINGS, "interpret", None)
    args = lambda **kw: argparse.Namespace(**{"target": "tpu", "model": "llama:1b", "seq": 2048, **kw})
    assert tpu_compile._tpu_attention(args(target="cpu")) is None and zoo.nn.SPLASH_SETTINGS["interpret"] is None
    assert tpu_compile._tpu_attention(args(seq=64)) is None
    assert tpu_compile._tpu_attention(args()) == "splash" and zoo.nn.SPLASH_SETTINGS["interpret"] is False
    assert tpu_compile._options(args(compiler_options=None)) == TPU_HOST_TRANSFER_OPTIONS
    assert tpu_compile._options(args(compiler_options={})) is None  # --compiler-options none
    assert tpu_compile._options(args(target="cpu", compiler_options="auto")) is None
