"""End-to-end evaluations of serving from disk: cold and warm serving
(``cold``), the hot set across a restart (``hotset``), decode and prefill
against a resident table (``northstar``), and long runs checked row by row
(``soak``, ``integrity_soak``)."""
