"""A synthetic agentic workload: sessions that resend a growing conversation every turn.

Shape (each session, all sizes in tokens)::

    turn 1 prompt: [system prompt (shared by all sessions)] [user]
    turn 2 prompt: [system] [user] [output 1] [tool output 1] [user]
    turn n prompt: turn n-1 prompt + [output n-1] [tool output n-1] [user]

Every session's whole token stream is cut into blocks of ``block_size`` tokens; the system prompt's blocks use
ids shared by every session, the rest get ids unique to the session. Turn ``n``'s ``hash_ids`` are the ids of
the blocks that cover its prompt, so a turn extends the previous turn exactly as an agent's next call does (a
block left partial by one turn keeps its id when the next turn fills it: the prompt text of a partial block is
a prefix of the full block's text). Sessions arrive as a Poisson process; turns within a session are separated
by think times (exponential), which a closed-loop replay uses.
"""

from __future__ import annotations

import math
import random
from typing import Annotated

import msgspec

from loadgen.traces import TraceRequest

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class SyntheticConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Parameters of the synthetic agentic workload."""

    num_sessions: PositiveInt = 16
    """Number of sessions."""
    num_turns: PositiveInt = 8
    """Turns (requests) per session."""
    system_prompt_tokens: NonNegativeInt = 2048
    """Tokens of the system prompt shared by every session."""
    user_tokens: PositiveInt = 200
    """Tokens of each user message."""
    tool_output_tokens: NonNegativeInt = 1500
    """Mean tokens of each tool output (uniform between half and one and a half times this)."""
    output_tokens: PositiveInt = 150
    """Output tokens of each turn."""
    think_time_s: NonNegativeFloat = 2.0
    """Mean think time between a turn's end and the next turn, in seconds (exponential)."""
    session_rate_per_s: Annotated[float, msgspec.Meta(gt=0.0)] = 0.5
    """Mean arrival rate of new sessions per second (Poisson)."""
    block_size: PositiveInt = 64
    """Tokens per hash id."""
    seed: int = 0
    """Seed of the random choices (the workload is a pure function of the config)."""


def generate(config: SyntheticConfig) -> list[TraceRequest]:
    """Generate the workload.

    Returns:
        Requests sorted by arrival; ``arrival_s`` of turn ``n > 1`` assumes the previous turn took no time (an
        open-loop replay uses it as a schedule; a closed-loop replay uses ``think_time_s`` instead).
    """
    rng = random.Random(config.seed)
    bs = config.block_size
    num_system_blocks = math.ceil(config.system_prompt_tokens / bs)
    next_id = num_system_blocks  # ids 0 .. num_system_blocks-1: the system prompt's blocks
    out: list[TraceRequest] = []
    session_start_s = 0.0
    for s in range(config.num_sessions):
        session_start_s += rng.expovariate(config.session_rate_per_s) if s else 0.0
        num_tokens = config.system_prompt_tokens  # tokens of the conversation so far
        block_ids: list[int] = list(range(num_system_blocks))
        # The system prompt's last block may be partial; the session's own text continues inside it, so from
        # there on the block is the session's own.
        if config.system_prompt_tokens % bs:
            block_ids[-1] = next_id
            next_id += 1
        t_s = session_start_s
        for turn in range(config.num_turns):
            think_time_s = rng.expovariate(1.0 / config.think_time_s) if turn and config.think_time_s > 0 else 0.0
            t_s += think_time_s
            if turn:
                tool = config.tool_output_tokens
                num_tokens += config.output_tokens + (rng.randint(tool // 2, tool + tool // 2) if tool else 0)
            num_tokens += config.user_tokens
            while len(block_ids) * bs < num_tokens:
                block_ids.append(next_id)
                next_id += 1
            out.append(
                TraceRequest(
                    arrival_s=t_s,
                    num_prompt_tokens=num_tokens,
                    num_output_tokens=config.output_tokens,
                    hash_ids=tuple(block_ids[: math.ceil(num_tokens / bs)]),
                    block_size=bs,
                    namespace="synthetic",
                    session_id=f"syn{s}",
                    think_time_s=think_time_s,
                )
            )
    out.sort(key=lambda r: r.arrival_s)
    return out
