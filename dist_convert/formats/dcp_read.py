"""The fallback read of torch_dist chunks through ``dcp.load`` (items stored with transforms or as views,
and bucket-space optimizer ranges): the one place that imports torch.distributed.checkpoint to read."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import ConvertError
from ..layout.boxes import Box
from .distcp import dcp_reader


class _BoxLoadPlanner(LoadPlanner):
    """Reads whole stored chunks (no resharding by DCP): requests are {key: [(box, out tensor)]}."""

    def __init__(self, requests: dict[str, list[tuple[Box, torch.Tensor]]]) -> None:
        self.requests = requests

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, reqs in self.requests.items():
            md = self.metadata.state_dict_metadata[key]
            wanted = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b, _ in reqs]
            items += create_read_items_for_chunk_list(key, md, wanted)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise AssertionError("no byte items are requested")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        _, out = self.requests[read_item.dest_index.fqn][read_item.dest_index.index]
        view = out
        for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            view = view.narrow(dim, o, n)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None


def read_boxes(iter_dir: Path, trust_pickle: bool, requests: dict[str, list[tuple[Box, torch.Tensor]]]) -> None:
    """Fill each request's tensor with its box of the stored key (every rank reads its own: no_dist)."""
    try:
        with warnings.catch_warnings():  # no_dist=True is intended: every rank reads its own chunks
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({}, storage_reader=dcp_reader(iter_dir, trust_pickle), planner=_BoxLoadPlanner(requests),
                     no_dist=True)
    except ConvertError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps every cause
        cause = next(iter(e.failures.values()), e) if isinstance(e, CheckpointException) else e
        msg = str(cause).strip().splitlines()[0][:160] if str(cause).strip() else type(cause).__name__
        raise ConvertError(f"reading {iter_dir} failed ({msg})",
                           "a .distcp file is corrupt or truncated; re-copy the checkpoint") from None
