"""Nested peak scopes over one global counter (DESIGN.md, pytorch issue 16266).

A stand-in counter behaves like CUDA's: one running peak, reset by anyone.
"""

from __future__ import annotations

import pytest

from nbmem.tracking.counters import PeakScopes


class StandInCounter:
    """One global allocated/reserved figure with a resettable running peak, like CUDA's."""

    def __init__(self) -> None:
        self.now = 0
        self.now_reserved = 0
        self._peak = 0
        self._peak_reserved = 0
        self.resets = 0

    def set(self, allocated: int, reserved: int | None = None) -> None:
        self.now = allocated
        self.now_reserved = max(reserved if reserved is not None else allocated, self.now_reserved)
        self._peak = max(self._peak, allocated)
        self._peak_reserved = max(self._peak_reserved, self.now_reserved)

    def allocated(self) -> int:
        return self.now

    def reserved(self) -> int:
        return self.now_reserved

    def peak_allocated(self) -> int:
        return self._peak

    def peak_reserved(self) -> int:
        return self._peak_reserved

    def reset_peak(self) -> None:
        self.resets += 1
        self._peak = self.now
        self._peak_reserved = self.now_reserved


@pytest.fixture
def counter():
    return StandInCounter()


def test_single_scope_records_start_and_peak(counter):
    counter.set(100)
    scopes = PeakScopes(counter)
    scope = scopes.open()
    counter.set(500)
    counter.set(200)
    closed = scopes.close(scope)
    assert (closed.allocated_before, closed.peak_allocated) == (100, 500)


def test_scope_ignores_peaks_before_it_opened(counter):
    counter.set(900)
    counter.set(100)
    scopes = PeakScopes(counter)
    scope = scopes.open()
    counter.set(300)
    assert scopes.close(scope).peak_allocated == 300


def test_inner_scope_reset_does_not_hide_outer_peak(counter):
    scopes = PeakScopes(counter)
    outer = scopes.open()
    counter.set(1000)  # the outer scope's peak, before the inner one resets the counter
    counter.set(100)
    inner = scopes.open()
    counter.set(400)
    counter.set(150)
    assert scopes.close(inner).peak_allocated == 400
    counter.set(200)
    assert scopes.close(outer).peak_allocated == 1000


def test_outer_scope_sees_peak_reached_inside_inner(counter):
    scopes = PeakScopes(counter)
    outer = scopes.open()
    counter.set(100)
    inner = scopes.open()
    counter.set(2000)
    counter.set(100)
    inner_result = scopes.close(inner)
    assert (inner_result.allocated_before, inner_result.peak_allocated) == (100, 2000)
    assert scopes.close(outer).peak_allocated == 2000


def test_three_levels_and_out_of_order_close(counter):
    scopes = PeakScopes(counter)
    first = scopes.open()
    counter.set(300)
    counter.set(0)
    second = scopes.open()
    counter.set(50)
    third = scopes.open()
    counter.set(700)
    counter.set(60)
    # close the middle one first: the others still get every peak
    assert scopes.close(second).peak_allocated == 700
    counter.set(800)
    assert scopes.close(first).peak_allocated == 800
    assert scopes.close(third).peak_allocated == 800
    assert len(scopes) == 0


def test_reserved_peaks_fold_like_allocated(counter):
    scopes = PeakScopes(counter)
    outer = scopes.open()
    counter.set(100, reserved=2048)
    inner = scopes.open()
    counter.set(150, reserved=4096)
    inner = scopes.close(inner)
    outer = scopes.close(outer)
    assert (inner.reserved_before, inner.peak_reserved) == (2048, 4096)
    assert (outer.reserved_before, outer.peak_reserved) == (0, 4096)


def test_closing_twice_is_harmless(counter):
    scopes = PeakScopes(counter)
    scope = scopes.open()
    scopes.close(scope)
    assert scopes.close(scope).closed


def test_adopt_raises_start_and_peak_of_open_scopes_only(counter):
    scopes = PeakScopes(counter)
    scope = scopes.open()
    counter.set(10)
    # as the tracker does: bytes found late raise the counter and every open scope alike
    counter.now += 512
    counter._peak += 512
    scopes.adopt(512)
    closed = scopes.close(scope)
    assert (closed.allocated_before, closed.peak_allocated) == (512, 512 + 10)
    later = scopes.open()
    assert scopes.close(later).allocated_before == 512 + 10


def test_closing_a_scope_never_removes_an_equal_looking_other(counter):
    scopes = PeakScopes(counter)
    outer = scopes.open()
    inner = scopes.open()  # same figures as the outer one
    scopes.close(inner)
    assert len(scopes) == 1 and not outer.closed
    assert scopes.close(outer) is outer and len(scopes) == 0
