"""The gateway's token bucket and flood detector, driven with explicit clock values."""

from __future__ import annotations

from apps.workers.ratelimit import FLOOD_WINDOW, LOG_INTERVAL, FrameRateLimit


def limit(*, rate: float = 10.0, burst: int = 3, flood_refusals: int = 5) -> FrameRateLimit:
    return FrameRateLimit(rate=rate, burst=burst, flood_refusals=flood_refusals, now=100.0)


def test_a_full_burst_is_admitted_then_frames_are_refused() -> None:
    bucket = limit()
    assert [bucket.admit(100.0) for _ in range(4)] == [True, True, True, False]
    assert (bucket.window_refusals, bucket.flooding) == (1, False)


def test_tokens_come_back_at_the_rate_and_never_beyond_the_burst() -> None:
    # given: an empty bucket
    bucket = limit(rate=4.0, burst=3)
    for _ in range(3):
        bucket.admit(100.0)
    # when / then: 0.25 s buys one frame, 0.125 s half of one
    assert bucket.admit(100.25) is True
    assert bucket.admit(100.375) is False
    # and an hour idle refills the burst only
    assert [bucket.admit(3700.0) for _ in range(4)] == [True, True, True, False]


def test_a_steady_sender_at_the_rate_is_never_refused() -> None:
    bucket = limit(rate=200.0, burst=1000, flood_refusals=1000)
    now = 100.0
    for _ in range(100_000):  # 500 s at exactly 200 frames/s
        now += 1 / 200
        assert bucket.admit(now)


def test_more_refusals_than_allowed_in_a_window_is_flooding() -> None:
    # given
    bucket = limit(burst=1, rate=0.001, flood_refusals=5)
    bucket.admit(100.0)
    # when: five refusals are tolerated, the sixth in the window is a flood
    for _ in range(5):
        assert bucket.admit(101.0) is False
    assert bucket.flooding is False
    assert bucket.admit(101.0) is False
    # then
    assert bucket.flooding is True


def test_refusals_spread_over_windows_are_not_a_flood() -> None:
    bucket = limit(burst=1, rate=0.001, flood_refusals=5)
    bucket.admit(100.0)
    now = 100.0
    for _ in range(4):
        for _ in range(5):
            assert bucket.admit(now) is False
        assert bucket.flooding is False
        now += FLOOD_WINDOW  # a new window: the count starts over
    assert bucket.window_refusals == 5


def test_refusals_are_logged_at_most_once_per_interval() -> None:
    # given: an empty bucket
    bucket = limit(burst=1, rate=0.001, flood_refusals=1000)
    bucket.admit(100.0)
    # when / then: the first refusal is logged at once, the next ones wait for the interval, and are counted
    bucket.admit(100.0)
    assert bucket.refusals_to_log(100.0) == 1
    for _ in range(7):
        bucket.admit(101.0)
    assert bucket.refusals_to_log(101.0) == 0
    assert bucket.refusals_to_log(100.0 + LOG_INTERVAL) == 7
    assert bucket.refusals_to_log(200.0) == 0  # nothing new


def test_a_frame_over_the_byte_bucket_is_refused_and_takes_nothing() -> None:
    # given: plenty of frames, 1000 bytes and 100 bytes/s
    bucket = FrameRateLimit(
        rate=10.0, burst=100, flood_refusals=5, now=100.0, byte_rate=100.0, byte_burst=1000
    )
    # when / then: 600 + 400 bytes fit, one more byte does not, and took no frame token
    assert [bucket.admit(100.0, 600), bucket.admit(100.0, 400), bucket.admit(100.0, 1)] == [True, True, False]
    assert (bucket.refused_for, bucket.window_refusals, bucket.tokens) == ("bytes", 1, 98.0)
    # and 0.5 s later 50 bytes are back
    assert bucket.admit(100.5, 51) is False
    assert bucket.admit(100.5, 50) is True
    assert bucket.refused_for == "bytes"


def test_without_a_byte_limit_any_size_is_admitted() -> None:
    bucket = limit(burst=2)
    assert [bucket.admit(100.0, 10**12), bucket.admit(200.0, 10**12)] == [True, True]
    assert bucket.admit(200.0, 0) is True
    assert (bucket.admit(200.0, 0), bucket.refused_for) == (False, "frames")
