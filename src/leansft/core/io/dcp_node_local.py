"""torch.distributed.checkpoint (DCP) for ranks that do not share a folder (node-local disks).

DCP writes each rank's shards into the rank's own file, but an item every rank holds alike (an optimizer's step
counts, its param groups) into one rank's file only, and ``.metadata`` names that file for every rank: on node-local
disks a node would lack what its ranks read. Here each group of ranks that shares a folder also writes those items
into its own files, and each group gets a ``.metadata`` that points its ranks at their group's files. The format stays
DCP's: every group's metadata is valid for all groups' files together, so the files of every node gathered in one
folder load (and reshard) as any DCP checkpoint.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

Groups = Sequence[Sequence[int]]


class _EveryGroupPlanner(DefaultSavePlanner):
    """DCP's plan (each replicated item given to one rank), plus: each group's first rank writes the replicated
    items no rank of its group was given."""

    def __init__(self, groups: Groups) -> None:
        super().__init__()
        self.groups = groups

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super()._create_global_plan(all_plans)
        given = {item.index.fqn: (rank, item) for rank, plan in enumerate(plans) for item in plan.items
                 if item.type != WriteItemType.SHARD}
        extra: dict[int, list] = {rank: [] for rank in range(len(plans))}
        for group in self.groups:
            extra[group[0]] += [item for rank, item in given.values() if rank not in group]
        return [dataclasses.replace(plan, items=[*plan.items, *extra[rank]]) for rank, plan in enumerate(plans)], \
            metadata


class _GroupMetadataWriter(FileSystemWriter):
    """DCP's file writer; on the coordinator it also keeps each group's ``.metadata``: where an item was written by
    several ranks, the copy in the group's own files."""

    def __init__(self, path: str, groups: Groups) -> None:
        super().__init__(path)
        self.groups = groups
        self.by_group: dict[tuple[int, ...], bytes] = {}

    def finish(self, metadata: Metadata, results: list) -> None:
        super().finish(metadata, results)
        for group in self.groups:
            order = [r for r in range(len(results)) if r not in group] + list(group)  # the group's own win
            where = {wr.index: wr.storage_data for r in order for wr in results[r]}
            self.by_group[tuple(group)] = pickle.dumps(dataclasses.replace(metadata, storage_data=where))


def save(state: dict, path: str, groups: Groups, process_group=None) -> dict[tuple[int, ...], bytes]:
    """``dcp.save`` of ``state`` into ``path`` on every rank (each group's folder), its collectives on
    ``process_group`` (default: the training's); returns, on rank 0, each group's ``.metadata`` bytes (to be written
    into that group's ``path``), elsewhere {}."""
    writer = _GroupMetadataWriter(path, groups)
    dcp.save(state, storage_writer=writer, planner=_EveryGroupPlanner(groups), process_group=process_group)
    return writer.by_group
