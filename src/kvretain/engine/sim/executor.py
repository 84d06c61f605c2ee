"""The simulated executor: prices a :class:`SchedulerOutput` with a cost model and "samples" tokens.

Sampled tokens are the request's planned output tokens (:meth:`SimRequest.output_token`), so the blocks
that decode fills get the hashes a follow-up turn will look up.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvretain.engine.sim.costmodel import CostModel
from kvretain.engine.sim.request import SimRequest
from kvretain.sched.output import RunnerOutput, SchedulerOutput


class SimExecutor:
    """Executes steps in zero wall time; :meth:`step_time` says how long they take in virtual time."""

    def __init__(self, cost: CostModel, requests: Mapping[str, SimRequest]) -> None:
        self.cost = cost
        self.requests = requests
        self.busy_s = 0.0

    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds the step takes: one roofline over all its prefill chunks and decode tokens. Only chunks
        that sample (decode tokens, the chunk that completes a prompt) go through the LM head."""
        prefill: list[tuple[int, int, bool]] = []
        decode: list[int] = []
        for c in out.chunks:
            if c.num_new_tokens == 1 and c.samples:
                decode.append(c.num_computed_tokens + 1)  # same cost as a one-token chunk that samples
            else:
                prefill.append((c.num_new_tokens, c.num_computed_tokens, c.samples))
        t = self.cost.step_time(prefill, decode)
        self.busy_s += t
        return t

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One token for every chunk that samples: the request's next planned output token."""
        reqs = self.requests
        ids: list[str] = []
        toks: list[int] = []
        for c in out.chunks:
            if c.samples:
                r = reqs[c.request_id]
                ids.append(c.request_id)
                toks.append(r.output_token(len(r.output_token_ids)))
        return RunnerOutput(tuple(ids), tuple(toks))
