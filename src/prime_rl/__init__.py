"""prime-rl's shared package: the contracts the three processes agree on, and the command line around them.

Read it by role (each process imports only the contracts; nothing here imports torch or vLLM):
- contracts (top level): ``config/`` (the typed schema, one module per owner), ``wire`` (the trainer's
  ZeroMQ messages), ``rundir`` (the run directory's layout), ``registry`` (environment ids),
  ``settings`` (TOML + flags -> config), ``keys`` (API keys and redaction), ``chat`` (chat templates),
  ``vllm_command`` (an inference config as vLLM's command: the inference process execs it, the
  launcher's dry run prints it), ``metrics`` and ``heartbeat`` (what processes write for the views),
  ``endpoints`` (named models);
- ``launch/``: from a validated config to running processes (resolve, placement and process specs,
  ports, tmux/headless launcher, warm servers, SLURM, resume, the memory estimate);
- ``observe/``: what users watch, readers of a run directory only (status pane, report);
- ``envs/``: the SDK users write environments with (datasets, rubrics, parsers, tools, the sandbox);
- ``cli`` and ``commands/``: the `prime-rl` command, one module per subcommand.
"""
