"""On a GPU host: lookups onto the GPU (``lookup``), a decode step with PLE
layers (``decode``), GPU-driven channels by number (``channels``), and the
checks of the GPU-driven route (``channel_check``, ``compile_check``,
``step_start_check``)."""
