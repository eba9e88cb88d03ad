"""Live migration's settings (decode_worker/migration.py): one definition for the code, the
serve config file's ``migration`` section and its rows in docs/config.md (engine/settings.py).
A module of its own so the config file's model reads it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.settings import check, setting


@dataclass(frozen=True)
class MigrationConfig:
    """Live migration on a decode worker; one definition for the code, the serve config file's
    ``migration`` section and its rows in docs/config.md (engine/settings.py)."""

    max_stages: int = setting(4, "KV copy rounds before the last, paused one.", ge=1)
    last_stage_blocks: int = setting(
        16, "Pause the request once at most this many KV blocks are left (Llumnix's bound).", ge=1
    )
    headroom_blocks: int = setting(
        4, "Blocks reserved on the destination beyond the request's length.", ge=0
    )
    """(It grows while copied; more is asked for before the last stage if it outgrew them.)"""
    chunk_tokens: int = setting(
        4096, "KV positions per copy message (bounds the copy buffers).", ge=1
    )
    """Gathered per call off the engine thread: 512 MiB for the 8B shape; the next chunk waits
    until the channel has room."""
    chunks_ahead: int = setting(
        1, "Copy messages that may be in flight when the next is gathered.", ge=1
    )
    """Each holds ``chunk_tokens`` of KV on this worker; 1: a gather overlaps one send. 2 moved a
    32k-token request no faster on 2 x H100 (57-72 against 66-75 GB/s; the gathers then share
    HBM with the sends: benchmarks/NOTES.md)."""
    timeout_s: float = setting(30.0, "Seconds each wait on the other worker may take.", gt=0)
    """Also the destination's deadline for a migration to complete."""
    max_out: int = setting(1, "Migrations out of one worker at once.", ge=1)
    max_in: int = setting(1, "Migrations into one worker at once.", ge=1)

    def __post_init__(self) -> None:
        check(self)
