"""A level meets the target of its arrivals: under a ramp >= 99 % of requests on time with TTFA
p99 <= 250 ms, under a burst every request on time with TTFA p99 <= 500 ms, under Poisson
arrivals every request on time with TTFA p95 <= 60 ms; none with errors or refusals. A result
file states the targets of the arrivals it holds."""

from __future__ import annotations

from bench.load import TARGETS, meets_target, target_text


def _level(arrivals: str | None, on_time: float = 1.0, p95: float = 50.0, p99: float = 240.0, **more) -> dict:
    point = {"errors": 0, "rejected": 0, "on_time_share": on_time, "ttfa_p95_ms": p95, "ttfa_p99_ms": p99}
    return {**point, **({"arrivals": arrivals} if arrivals else {}), **more}


def test_a_burst_is_given_500_ms_and_no_late_request():
    assert meets_target(_level("burst", p99=480.0))
    assert not meets_target(_level("ramp", p99=480.0))  # a ramp's first audio is held to 250 ms
    assert not meets_target(_level("burst", p99=520.0))
    assert not meets_target(_level("burst", on_time=0.996, p99=300.0))  # one late request of 256
    assert meets_target(_level("ramp", on_time=0.996, p99=240.0))


def test_poisson_arrivals_are_held_to_their_p95():
    assert meets_target(_level("poisson", p95=58.0, p99=90.0))
    assert not meets_target(_level("poisson", p95=62.0, p99=90.0))
    assert not meets_target(_level("poisson", on_time=0.999, p95=40.0))


def test_errors_refusals_and_a_level_without_arrivals():
    assert not meets_target(_level("burst", errors=1))
    assert not meets_target(_level("burst", rejected=3))  # past capacity: not a level that meets it
    assert meets_target(_level(None)) and not meets_target(_level(None, p99=260.0))  # a ramp's


def test_a_result_file_states_the_targets_of_its_arrivals():
    assert target_text(["burst", "burst"]) == (
        "no errors or rejections, every request fully on time, p99 TTFA <= 500 ms"
    )
    assert (
        target_text(["ramp"])
        == "no errors or rejections, >= 99% of requests fully on time, p99 TTFA <= 250 ms"
    )
    both = target_text(["poisson", "burst"])
    assert both == f"burst: {TARGETS['burst'].text()}; poisson: {TARGETS['poisson'].text()}"
    assert target_text([]) == TARGETS["ramp"].text()
    curve = [{"arrivals": "burst"}, {"arrivals": "burst"}]  # as a result file's levels name them
    assert target_text(p["arrivals"] for p in curve) == TARGETS["burst"].text()
