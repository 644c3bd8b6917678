"""The pure stall decisions (core/stall.py): who is stalled, what a collective timeout says, what a stop gives."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_provider_torchelastic.core import stall
from airflow_provider_torchelastic.core.stall import RankBeat, judge


def test_a_live_rank_silent_past_the_limit_is_stalled_and_the_others_are_named() -> None:
    beats = [
        RankBeat(rank=0, last_beat=100.0),  # silent 60 s
        RankBeat(rank=1, last_beat=150.0),  # silent 10 s: not yet
        RankBeat(rank=2, last_beat=10.0, alive=False),  # gone without returning
        RankBeat(rank=3, last_beat=20.0, done=True),  # returned
    ]
    found = judge(beats, now=160.0, limit=30.0)
    assert found is not None
    assert found.silent == ((0, 60.0),) and found.gone == (2,) and found.returned == (3,)
    message = found.message()
    assert "rank 0 for 60 s silent" in message and "rank(s) 2 left without a result" in message
    assert "rank(s) 3 had returned" in message and "recoverable" in message


def test_no_stall_within_the_limit_with_the_limit_off_or_for_finished_and_dead_ranks() -> None:
    beats = [RankBeat(rank=0, last_beat=0.0, done=True), RankBeat(rank=1, last_beat=0.0, alive=False)]
    assert judge(beats, now=1000.0, limit=30.0) is None
    assert judge([RankBeat(rank=0, last_beat=0.0)], now=1000.0, limit=None) is None
    assert judge([RankBeat(rank=0, last_beat=990.0)], now=1000.0, limit=30.0) is None


def test_the_longest_silent_rank_comes_first() -> None:
    beats = [RankBeat(rank=0, last_beat=50.0), RankBeat(rank=1, last_beat=10.0)]
    found = judge(beats, now=100.0, limit=5.0)
    assert found is not None and found.ranks == (1, 0)


@pytest.mark.parametrize(
    "text",
    [
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
        "operation to complete",
        "Timed out waiting 60000ms for send operation to complete",
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 ms",
    ],
)
def test_a_collective_timeout_is_recognized_and_said_as_a_stall(text: str) -> None:
    assert stall.is_collective_timeout(text)
    said = stall.collective_timeout_message(text)
    assert said.startswith("a collective timed out") and "recoverable" in said and text in said


def test_a_peer_address_in_a_timeout_is_named_and_other_errors_are_not_timeouts() -> None:
    said = stall.collective_timeout_message("Timed out waiting 1000ms for recv from [10.0.0.7]:41234")
    assert "10.0.0.7:41234" in said
    assert not stall.is_collective_timeout("Connection closed by peer [10.0.0.7]:41234")
    assert not stall.is_collective_timeout("ValueError: bad shape")


def test_the_settings_are_checked_and_rendered() -> None:
    assert stall.check_stall_timeout(timedelta(minutes=2)) == 120.0
    assert stall.check_stall_timeout(None) is None
    assert stall.check_grace_period(45) == 45.0
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="stall_timeout: expected seconds > 0"):
            stall.check_stall_timeout(bad)
    for bad_type in ("60", True, [1]):
        with pytest.raises(TypeError, match="termination_grace_period"):
            stall.check_grace_period(bad_type)
    with pytest.raises(TypeError, match="termination_grace_period"):
        stall.check_grace_period(None)
    assert stall.liveness_env(None, 60.0) == {stall.STALL_TIMEOUT_ENV: "none", stall.GRACE_PERIOD_ENV: "60"}
    assert stall.grace_period_seconds(59.2) == 60
    # The workers get most of the grace period; the runner keeps at most 10 s (a quarter of a short one).
    assert stall.shutdown_timeout(60.0) == 50.0 and stall.shutdown_timeout(8.0) == 6.0


def test_the_forensics_location_is_read_back_from_a_failure_message_even_inside_json() -> None:
    message = "no progress …; stacks and traces kept at s3://b/ckpt/forensics/try-1/pod-0 (recoverable)"
    assert stall.forensics_location(message) == "s3://b/ckpt/forensics/try-1/pod-0"
    import json

    assert stall.forensics_location(json.dumps({"m": message + "; x"})) == "s3://b/ckpt/forensics/try-1/pod-0"
    assert stall.forensics_location("rank 0 failed with ValueError: bad") is None
