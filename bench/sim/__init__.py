"""Simulations over recorded traces, without a server: the real-text trace of
row ids (``text_trace``) and the row cache against the page cache at equal
bytes (``cache_sim``)."""
