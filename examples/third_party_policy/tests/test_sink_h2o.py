"""The whole kvpolicy contract for SinkH2O: the ``kvpolicy_contract`` fixture (kvpolicy's pytest
plugin) runs this test once per property of the contract."""

from hypothesis import strategies as st

from kvpolicy_sink_h2o import SinkH2O


def test_sink_h2o_keeps_the_kvpolicy_contract(kvpolicy_contract):
    kvpolicy_contract(SinkH2O, {"sink": st.integers(1, 3), "heavy": st.integers(1, 6), "recent": st.integers(1, 4)})
