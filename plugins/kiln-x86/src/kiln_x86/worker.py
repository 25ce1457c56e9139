"""The x86 worker: Kiln's reference worker, with a thread count chosen per step.

Contract: a step that computes at least ``x86.min_prefill_tokens`` tokens (all its requests
together) runs on ``num_prefill_threads`` model threads, any other on ``num_threads``
(``kiln_x86.binding.BindingPlan``; the platform pins the pool for the larger count at start-up).
The choice changes speed only: every kernel computes a row the same way on any thread count.
Start-up work (the warm-up run, graph capture) runs on ``num_threads``, so decode graphs are
built for the count decode steps run on.
"""

from __future__ import annotations

import torch

from kiln.plugin_api import KilnConfig, ModelRunnerOutput, SchedulerOutput, Worker


class X86Worker(Worker):
    def __init__(
        self, config: KilnConfig, local_rank: int, rank: int, distributed_init_method: str
    ) -> None:
        super().__init__(config, local_rank, rank, distributed_init_method)
        plan = self.platform.thread_plan(config)
        self.num_threads, self.num_prefill_threads = plan.num_threads, plan.num_prefill_threads
        self.min_prefill_tokens = self.platform.options(config).min_prefill_tokens

    def step_threads(self, scheduler_output: SchedulerOutput) -> int:
        """Model threads for this step."""
        if scheduler_output.total_num_scheduled_tokens >= self.min_prefill_tokens:
            return self.num_prefill_threads
        return self.num_threads

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        threads = self.step_threads(scheduler_output)
        # A switch costs ~25 us (libgomp keeps its pool threads, and their pinning, between
        # team sizes); a step takes milliseconds.
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return super().execute_model(scheduler_output)
