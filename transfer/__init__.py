"""KV transfer: engine-neutral backends, page -> block math, and the KV manager/sender/receiver."""

from transfer.base import (
    UNFENCED,
    Block,
    Fence,
    FencesWrites,
    NotifiesCompletion,
    PeerId,
    TransferBackend,
    WriteHandle,
    WriteState,
)
from transfer.blocks import RegionSet, kv_blocks, merge_runs
from transfer.errors import TransferError, TransferErrorKind
from transfer.manager import KVManager
from transfer.receiver import KVReceiver
from transfer.registry import available_backends, create_backend
from transfer.sender import KVSender
from transfer.types import KVArgs, KVPoll, KVTimeouts

__all__ = [
    "UNFENCED",
    "Block",
    "Fence",
    "FencesWrites",
    "KVArgs",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTimeouts",
    "NotifiesCompletion",
    "PeerId",
    "RegionSet",
    "TransferBackend",
    "TransferError",
    "TransferErrorKind",
    "WriteHandle",
    "WriteState",
    "available_backends",
    "create_backend",
    "kv_blocks",
    "merge_runs",
]
