"""Which micro-batches each optimizer step trains, on which rank, and which are held out.

    plan = StepPlan(cfg, store.sample_ids, store.lengths, world_size, rank)
    for step, rank_loads in plan.rank_steps(0, 0, 0): ...   # this rank's micro-batches per step

Every rank computes the same epoch plan (training/data.py `epoch_plan`); an optimizer step
takes grad_accum x W consecutive micro-batches of it, and micro-batch j of the step goes to
rank j % W. A checkpoint records where the next step starts (epoch, index in its plan), so a
resume continues the same stream.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..config import Config
from .build import train_seed
from .data import epoch_plan, pack, split_ids

# (epoch, index in its plan, sample ids): one micro-batch of the global stream
MicroBatch = tuple[int, int, list[int]]


class StepPlan:
    """The held-out split, the number of steps, and the micro-batches of each step and evaluation."""

    def __init__(self, cfg: Config, sample_ids: np.ndarray, lengths: np.ndarray, world_size: int, rank: int):
        self.cfg, self.train_cfg = cfg, cfg.train
        train_cfg = self.train_cfg
        self.world_size, self.rank = world_size, rank
        self.lengths = dict(zip(sample_ids.tolist(), lengths.tolist()))
        self.train_ids, self.eval_ids = split_ids(sample_ids, train_cfg.eval_fraction, cfg.run.seed)
        if len(self.train_ids) == 0:
            raise ValueError("train: no training samples (is the store empty, or train.eval_fraction 1?)")
        self.eval_ids = self.eval_ids[: train_cfg.eval_max_samples]
        self.held_out = pack(self.eval_ids, self.lengths, train_cfg.max_tokens)  # every evaluation's micro-batches
        self.micro_per_step = train_cfg.grad_accum * world_size
        batches = len(epoch_plan(self.train_ids, self.lengths, train_cfg.max_tokens, train_seed(cfg), 0))
        self.steps_per_epoch = max(batches // self.micro_per_step, 1)
        total = self.steps_per_epoch * train_cfg.epochs
        self.total_steps = min(total, train_cfg.max_steps) if train_cfg.max_steps else total

    def micro_batches(self, epoch: int, start: int) -> Iterator[MicroBatch]:
        """The global micro-batch stream (the same on every rank): (epoch, index in its plan, sample ids)."""
        while True:
            plan = epoch_plan(self.train_ids, self.lengths, self.train_cfg.max_tokens, train_seed(self.cfg), epoch)
            # Packing another permutation can give a different number of micro-batches than
            # epoch 0's plan, from which steps_per_epoch was counted: never index past it.
            usable = min(self.steps_per_epoch * self.micro_per_step, len(plan))
            for i in range(start, usable):
                yield epoch, i, plan[i]
            epoch, start = epoch + 1, 0

    def rank_steps(self, step: int, epoch: int, start: int) -> Iterator[tuple[int, list[MicroBatch]]]:
        """The optimizer steps after `step` (the next micro-batch being plan[start] of `epoch`):
        (the step's number, this rank's grad_accum micro-batches as (epoch, index in its plan,
        sample ids)). Micro-batch j of a step (j = a*W + rank) is this rank's, and the epoch and
        index are those of the step's last micro-batch over all ranks: where a checkpoint after
        the step resumes."""
        data = self.micro_batches(epoch, start)
        W, r = self.world_size, self.rank
        while step < self.total_steps:
            rank_loads = []
            for _ in range(self.train_cfg.grad_accum):
                share = [next(data) for _ in range(W)]
                rank_loads.append((share[-1][0], share[-1][1], share[r][2]))
            step += 1
            yield step, rank_loads

    def eval_batches(self) -> list[list[int]]:
        """This rank's held-out micro-batches at an evaluation, in order: r, r+W, ..., the last
        repeated by a rank past the end (see Trainer.evaluate)."""
        n, W, r = len(self.held_out), self.world_size, self.rank
        return [self.held_out[min(first + r, n - 1)] for first in range(0, n, W)]

    def evaluates_at(self, step: int) -> bool:
        return bool(self.train_cfg.eval_every and step % self.train_cfg.eval_every == 0) or step == self.total_steps

    def planned_loads(self, step: int, epoch: int, start: int) -> Iterator[list[int]]:
        """Every micro-batch this rank loads from `step` to the end, in the order the loop and its
        evaluations load them (both follow rank_steps), made as they are asked for: what a stream
        computes ahead, and what Prefetch reads ahead."""
        for step, rank_loads in self.rank_steps(step, epoch, start):
            yield from (ids for _, _, ids in rank_loads)
            if self.evaluates_at(step):
                yield from self.eval_batches()
