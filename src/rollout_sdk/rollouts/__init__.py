"""The rollouts layer: what a rollout is and how many of them stream, independent of any client.

See docs/architecture.md.  Importing this package starts nothing.
"""

from .context import RolloutContext
from .continuation import Continuation
from .group import Agent, RewardFn, Sample, group_stats, reward_of, rollout_group
from .results import Group, ResultStream
from .stream import GenerateAgent, RolloutBatch, RolloutStream
from .trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder, Turn

__all__ = [
    "Agent",
    "Continuation",
    "GenerateAgent",
    "Group",
    "ResultStream",
    "RewardFn",
    "RolloutBatch",
    "RolloutContext",
    "RolloutStream",
    "Sample",
    "ToolCallRecord",
    "Trajectory",
    "TrajectoryBuilder",
    "Turn",
    "group_stats",
    "reward_of",
    "rollout_group",
]
