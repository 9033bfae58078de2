"""Inference clients: plain HTTP (httpx2) to vLLM's OpenAI-compatible server, or to an
endpoint's chat API. By concern:

- ``sampling``: the three kinds of server, one client class each (``InferenceClient`` for
  the policy's replicas, ``TeacherClient``, ``ChatClient``), each made of the parts below;
- ``pool``: the replicas of one server: routing, the concurrency cap, retries (tenacity);
- ``trust``: who gets the API key (a server this run started proves it holds it first);
- ``admin``: vLLM's admin calls on the policy's replicas (reload, pause/resume, probe);
- ``parse``: what vLLM's answers mean, as pure functions.

The clients know nothing about environments, steps or the run directory.
"""

from orchestrator.client.parse import FULL_DISTRIBUTION, Completion, InferenceError, cache_salt
from orchestrator.client.sampling import ChatClient, InferenceClient, TeacherClient

__all__ = [
    "FULL_DISTRIBUTION",
    "ChatClient",
    "Completion",
    "InferenceClient",
    "InferenceError",
    "TeacherClient",
    "cache_salt",
]
