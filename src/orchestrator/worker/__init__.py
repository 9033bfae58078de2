"""The environment worker's own files (run in the environment's Python, see vfworker_main).

Only files named ``vfworker_*`` live here: the folder is the worker's ``sys.path[0]``, so any
other name could shadow a module of the user's environment. The orchestrator's side of the
worker is ``orchestrator.envworker``.
"""
