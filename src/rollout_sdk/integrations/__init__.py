"""Adapters for trainers that own their training loop (TRL; docs/integrations.md for verl, OpenRLHF, prime-rl).

Nothing here is imported by ``import rollout_sdk``; each adapter imports its trainer library when used.
"""

from .bridge import RolloutBridge

__all__ = ["RolloutBridge"]
