"""Leaving the process group: an NCCL abort that does not finish (NCCL may wait for a dead rank while
freeing) must not hang the engine's close."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import nanoinfer.distributed as distributed


def test_destroy_waits_for_a_stuck_abort_only_so_long(monkeypatch, caplog):
    release = threading.Event()
    stuck_abort = threading.Thread(target=release.wait, daemon=True)
    stuck_abort.start()
    # As left by the watchdog, which started the abort when a worker died.
    monkeypatch.setattr(distributed, "_abort_thread", stuck_abort)
    monkeypatch.setattr(distributed, "ABORT_TIMEOUT_S", 0.2)
    start = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="nanoinfer.distributed"):
        assert distributed.destroy_process_group() is False
    assert time.monotonic() - start < 2
    assert "did not abort within 0.2 s" in caplog.text
    # No new tensor-parallel engine in this process while that abort hangs.
    with pytest.raises(RuntimeError, match="needs a new process"):
        distributed.ensure_no_process_group()
    # Once the abort has finished, closing completes and a later engine starts from a clean state.
    release.set()
    assert distributed.destroy_process_group() is True
    assert distributed._abort_thread is None
