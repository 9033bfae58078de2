"""Table of malformed configs: each must stop `prime-rl` before any process starts, with
exit code 2 and one line naming the offending key (and nothing written to the run dir)."""

import pytest

from prime_rl.cli import main

BASE = 'output_dir = "{run}"\n'

# (config text appended to BASE, extra CLI flags, text the one-line error must contain)
CASES = [
    # unknown keys, in every section and at the top level
    ("lr = 1\n", [], "unknown key `lr` in [top level]"),
    ("[trainer]\nlrr = 1\n", [], "unknown key `lrr` in [trainer]"),
    ("[trainer.optim]\nlearning_rate = 1e-4\n", [], "unknown key `learning_rate` in [trainer.optim]"),
    ("[trainer.loss]\nclip = 0.2\n", [], "unknown key `clip` in [trainer.loss]"),
    ("[orchestrator]\nbatchsize = 8\n", [], "unknown key `batchsize` in [orchestrator]"),
    ("[orchestrator.sampling]\ntop_q = 1\n", [], "unknown key `top_q` in [orchestrator.sampling]"),
    ("[inference]\ngpus = 2\n", [], "unknown key `gpus` in [inference]"),
    ("[sampling]\nmax_token = 5\n", [], "unknown key `max_token` in [sampling]"),
    ("[[env]]\nid = 'reverse-text'\narg = {}\n", [], "unknown key `arg` in [env.0]"),
    ("[wandb]\nprojekt = 'x'\n", [], "unknown key `projekt` in [wandb]"),
    ("", ["--trainer.optim.lrr", "1"], "unknown key `lrr` in [trainer.optim]"),
    # wrong types
    ("max_steps = 'ten'\n", [], "max_steps: Input should be a valid integer"),
    ("seq_len = 1.5\n", [], "seq_len: Input should be a valid integer"),
    ("[trainer.optim]\nlr = 'fast'\n", [], "trainer.optim.lr: Input should be a valid number"),
    ("[inference]\nenforce_eager = 'maybe'\n", [], "inference.enforce_eager: Input should be a valid boolean"),
    ("env = 'reverse-text'\n", [], "env: Input should be a valid list"),
    ("[trainer]\nmodel = 'x'\n", [], "trainer.model: Input should be a valid dictionary"),
    ("", ["--max-steps", "many"], "max_steps: Input should be a valid integer"),
    # out-of-range values
    ("[trainer.optim]\nlr = -1e-4\n", [], "trainer.optim.lr: Input should be greater than 0"),
    ("max_steps = 0\n", [], "max_steps: Input should be greater than or equal to 1"),
    ("async_level = -1\n", [], "async_level: Input should be greater than or equal to 0"),
    ("batch_size = 10\nrollouts_per_example = 4\n", [], "batch_size (10) must be divisible by rollouts_per_example (4)"),
    ("[sampling]\ntemperature = 0\n", [], "sampling.temperature: Input should be greater than 0"),
    ("[orchestrator]\nmax_off_policy_steps = 0\n", [], "max_off_policy_steps (0) must be at least async_level (1)"),
    ("[orchestrator.traces]\ngroups = -1\n", [], "orchestrator.traces.groups"),
    ("[orchestrator.traces]\ngroups = 'some'\n", [], "orchestrator.traces.groups"),
    ("[dashboard]\nport = 0\n", [], "dashboard.port: Input should be greater than or equal to 1"),
    ("[dashboard]\nenable = true\n", [], "unknown key `enable` in [dashboard]"),
    # truncated sampling: the trainer scores the full softmax
    ("[sampling]\ntop_p = 0.8\n", [], "top_p = 0.8: truncated sampling is not supported in RL"),
    ("[sampling]\ntop_k = 20\n", [], "top_k = 20: truncated sampling is not supported in RL"),
    ("", ["--sampling.min-p", "0.1"], "min_p = 0.1: truncated sampling is not supported in RL"),
    ("[inference]\nport = 80\n", [], "inference.port: Input should be greater than or equal to 1024"),
    ("[trainer.loss]\nmask_ratio_low = 2.0\nmask_ratio_high = 1.5\n", [], "mask_ratio_low must be below mask_ratio_high"),
    ("[trainer.loss]\nlog_ratio_clamp = 2.0\n", [], "must lie inside the log-ratio clamp"),
    ("[orchestrator.filter]\nmin_mean_reward = 0.8\nmax_mean_reward = 0.2\n", [], "min_mean_reward (0.8) must not exceed max_mean_reward (0.2)"),
    ("[trainer.loss]\nimportance = 'geo'\n", [], "trainer.loss.importance: Input should be 'token_mask', 'sequence_mask'"),
    ("batch_size = 2\nrollouts_per_example = 1\n[orchestrator]\nnum_trainer_ranks = 3\n", [],
     "batch_size (2) must be at least num_trainer_ranks (3): every rank needs a sample"),
    ("[trainer.optim]\nmax_grad_norm = 0\n", [], "trainer.optim.max_grad_norm: Input should be greater than 0"),
    # a model path that does not exist
    ('model = "{run}/no/such/model"\n', [], "trainer.model.name: model path"),
    # unknown environment id
    ('[[env]]\nid = "primeintellect/alphabet-sorter"\n', [], "unknown environment id 'primeintellect/alphabet-sorter'"),
    # a tool environment without vLLM's tool-call parser
    ('[[env]]\nid = "primeintellect/wiki-search"\n', [], "environment 'primeintellect/wiki-search' calls tools: set `[inference] tool_call_parser`"),
    # conflicting values between a shared field and a section
    ("max_steps = 3\n[trainer]\nmax_steps = 4\n", [], "conflicting values: `max_steps` = 3 but `trainer.max_steps` = 4"),
    ("seq_len = 128\n[inference]\nseq_len = 256\n", [], "conflicting values: `seq_len` = 128 but `inference.seq_len` = 256"),
    # not TOML at all
    ("max_steps = = 3\n", [], "not valid TOML"),
    # nesting that would otherwise crash with a RecursionError: tomllib's parser (arrays, inline
    # tables), the walk of a merged config, the error formatter's repr, JSON in a flag
    ("max_steps = " + "[" * 100_000 + "]" * 100_000 + "\n", [], "not valid TOML: tables or arrays nested more than 64"),
    ("[[env]]\nargs = " + "{a = " * 1000 + "1" + "}" * 1000 + "\n", [], "not valid TOML: tables or arrays nested more than 64"),
    ("max_steps = " + "[" * 100 + "]" * 100 + "\n", [], "`max_steps.0.0`: tables or arrays nested more than 64 levels deep"),
    ("[[env]]\nargs." + ".".join(["a"] * 1000) + " = 1\n", [], "`env.0.args`: tables or arrays nested more than 64"),
    ("[" + ".".join(["a"] * 1000) + "]\n", [], "`a.a.a`: tables or arrays nested more than 64 levels deep"),
    ("", ["--max-steps", "[" * 100_000 + "]" * 100_000], "flag --max-steps: tables or arrays nested more than 64"),
    ("", ["--max-steps", "[" * 100 + "]" * 100], "flags: `max_steps.0.0`: tables or arrays nested more than 64"),
    ("", ["--" + ".".join(["a"] * 1000), "1"], "flags: `a.a.a`: tables or arrays nested more than 64"),
    # non-finite floats: every batch would fail the wire's finite check and the trainer time out
    ("[sampling]\ntemperature = inf\n", [], "sampling.temperature: Input should be a finite number"),
    ("[trainer.optim]\nlr = inf\n", [], "trainer.optim.lr: Input should be a finite number"),
    ("[trainer.optim]\nlr = nan\n", [], "trainer.optim.lr: Input should be a finite number"),
    ("", ["--trainer.optim.lr", "inf"], "trainer.optim.lr: Input should be a finite number"),
    ("", ["--sampling.temperature", "nan"], "sampling.temperature: Input should be a finite number"),
    ("[trainer.optim]\nmax_grad_norm = inf\n", [], "trainer.optim.max_grad_norm: Input should be a finite number"),
    ("[[env]]\nid = 'reverse-text'\nweight = nan\n", [], "env.0.weight: Input should be a finite number"),
    # ... and in environment args, at any depth: the resolved config (JSON) would hand the
    # environment None instead
    ("[[env]]\nargs = { threshold = nan }\n", [], "env.0.args: `threshold`: expected a finite number, got nan"),
    ("[[env]]\nargs = { a = { b = [1.0, 2, { c = -inf }] } }\n", [], "env.0.args: `a.b[2].c`: expected a finite number, got -inf"),
    ("[[env]]\nargs = { big = 1e999 }\n", [], "env.0.args: `big`: expected a finite number, got inf"),
    ("[[env]]\n[[env]]\nid = 'alphabet-sort'\nargs.x = [[+inf]]\n", [], "env.1.args: `x[0][0]`: expected a finite number, got inf"),
    ("", ["--env", '[{"id": "reverse-text", "args": {"t": NaN}}]'], "env.0.args: `t`: expected a finite number, got nan"),
    ("", ["--env", '[{"args": {"s": [{"t": -Infinity}]}}]'], "env.0.args: `s[0].t`: expected a finite number, got -inf"),
    # checkpoints and resuming
    ("[ckpt]\ninterval = -1\n", [], "ckpt.interval: Input should be greater than or equal to 0"),
    ("[orchestrator.ckpt]\ninterval = 3\n", [], "conflicting values: `orchestrator.ckpt` differs from `trainer.ckpt`"),
    ("", ["--resume"], "--resume: no complete checkpoint in {run}/checkpoints"),
    ("", ["--resume-step", "two"], "--resume-step: expected a checkpoint step (an integer >= 1), got 'two'"),
    ("", ["--resume", "--clean"], "--clean and --resume contradict each other"),
]


@pytest.mark.parametrize("text, flags, expected", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_malformed_config_stops_before_any_process(tmp_path, capsys, text, flags, expected):
    run = tmp_path / "run"
    config = tmp_path / "bad.toml"
    config.write_text((BASE + text).replace("{run}", str(run)))
    expected = expected.replace("{run}", str(run))
    with pytest.raises(SystemExit) as exit_info:
        main([str(config), "--no-tmux", *flags])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert expected in err, err
    assert len(err.splitlines()) == 1, err
    assert not run.exists(), "a rejected config must not create or touch the run directory"


@pytest.mark.parametrize("args, expected", [
    ('{"threshold": NaN}', "`threshold`: expected a finite number, got nan"),
    ('{"a": {"b": [1, Infinity]}}', "`a.b[1]`: expected a finite number, got inf"),
    ('{"a": [[{"c": -Infinity}]]}', "`a[0][0].c`: expected a finite number, got -inf"),
    ('{"big": -1e999}', "`big`: expected a finite number, got -inf"),
])
def test_env_args_flag_refuses_nan_and_inf_naming_the_key(tmp_path, capsys, args, expected):
    """`prime-rl eval|gepa ENV -a JSON`: Python's json reads NaN and Infinity (and 1e999 as inf)."""
    for command in ("eval", "gepa"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "reverse-text", "-a", args, "--output-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2, err
        assert err == f"prime-rl: -a/--env-args: {expected}", err
        assert not (tmp_path / "out").exists()


def test_finite_env_args_pass(tmp_path):
    from prime_rl.config import EnvConfig, RLConfig

    args = {"t": 0.5, "n": [1, -2.5e300, {"x": 0.0}], "s": "nan", "flag": True, "none": None}
    assert EnvConfig(args=args).args == args
    eval_entry = {"id": "reverse-text", "env_args": {"inf": "inf"}}  # a key or string named inf is fine
    from prime_rl.config import EvalRunConfig

    assert EvalRunConfig.model_validate({"eval": [eval_entry]}).eval[0].args == {"inf": "inf"}
    assert RLConfig.model_validate({"env": [{"args": args}]}).orchestrator.env[0].args == args
