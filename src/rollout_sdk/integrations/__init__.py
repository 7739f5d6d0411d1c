"""Adapters for trainers that own their training loop (TRL; docs/integrations.md for verl, OpenRLHF, prime-rl) and
for environment libraries (text_env, verifiers_env: docs/environments.md).

Nothing here is imported by ``import rollout_sdk``; each adapter imports its trainer library when used.
"""

from .bridge import RolloutBridge

__all__ = ["RolloutBridge"]
