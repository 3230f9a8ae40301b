"""The bell that answers an agent's long poll (controller/command_bell.py): rung for a node once a session
that queued a command for it commits, never for a rolled-back one, never before the commit."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from controller.command_bell import BELL
from controller.db import session_scope
from controller.recovery import commands
from vigil.contract.schemas import CommandKind


def test_the_bell_rings_for_the_node_once_the_session_commits(sessions: sessionmaker[Session]) -> None:
    node, other = "bell-node-a", "bell-node-b"
    before, before_other = BELL.count(node), BELL.count(other)
    with session_scope(sessions) as s:
        commands.enqueue(s, node, CommandKind.STOP_PID, {"pid": 1234})
        commands.enqueue(s, node, CommandKind.STOP_PID, {"pid": 1235})
        assert BELL.count(node) == before  # not yet committed: an answered poll would find nothing
    assert BELL.count(node) == before + 1  # one commit, one ring
    assert BELL.count(other) == before_other


def test_a_rolled_back_session_rings_nothing_and_the_next_commit_rings_only_its_own(
        sessions: sessionmaker[Session]) -> None:
    node, later = "bell-node-c", "bell-node-d"
    before = BELL.count(node)
    with pytest.raises(RuntimeError), session_scope(sessions) as s:
        commands.enqueue(s, node, CommandKind.STOP_PID, {"pid": 1234})
        raise RuntimeError("the pass failed")
    assert BELL.count(node) == before
    s = sessions()
    try:
        commands.enqueue(s, node, CommandKind.STOP_PID, {"pid": 1234})
        s.rollback()
        commands.enqueue(s, later, CommandKind.STOP_PID, {"pid": 1234})
        s.commit()
    finally:
        s.close()
    assert BELL.count(node) == before
    assert BELL.count(later) >= 1
