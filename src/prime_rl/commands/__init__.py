"""The `prime-rl` commands, one module each, each with ``main(argv) -> exit code``.

``prime_rl.cli`` holds the table of commands and dispatches to them; what several commands
share (output folders, help generated from the config fields, eval's and gepa's options)
lives in ``common``, so no command imports another.
"""
