"""The rollouts layer: what a rollout is and how many of them stream, independent of any client.

See docs/architecture.md.  Importing this package starts nothing.
"""

from ..protocol.segments import append_segments, result_segments
from .context import RolloutContext
from .continuation import Continuation
from .generator import USE_CLIENT_DEFAULT, Generator, Prompt, UseClientDefault, as_request
from .group import Agent, RewardFn, Sample, group_stats, reward_of, rollout_group, run_trajectory
from .producer import ProducerStatistics, StreamState
from .results import Group, ResultStream
from .seeds import sample_seed
from .stream import GenerateAgent, RolloutBatch, RolloutStream
from .trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder, Turn

__all__ = [
    "USE_CLIENT_DEFAULT",
    "Agent",
    "Continuation",
    "GenerateAgent",
    "Generator",
    "Group",
    "ProducerStatistics",
    "Prompt",
    "ResultStream",
    "RewardFn",
    "RolloutBatch",
    "RolloutContext",
    "RolloutStream",
    "Sample",
    "StreamState",
    "ToolCallRecord",
    "Trajectory",
    "TrajectoryBuilder",
    "Turn",
    "UseClientDefault",
    "append_segments",
    "as_request",
    "group_stats",
    "result_segments",
    "reward_of",
    "rollout_group",
    "run_trajectory",
    "sample_seed",
]
