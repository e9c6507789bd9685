"""Shared by the property tests of damaged files (checkpoints, grid run folders): any JSON value, and the
hypothesis settings they run with."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# any JSON value: scalars (ints past 64 bits, NaN and infinities among the floats), short lists and objects
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
