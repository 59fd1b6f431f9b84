"""vLLM 0.33's own engine on a GPU host, stock against the plugin
(``bench/device_vllm.sh``): the coordinator and each cell's process
(``coordinator``), the cells and plans (``cells``), exactness against stock's
spread (``exact``), the server's trace cut into vLLM's steps (``steps``), the
rows of every step against the checkpoint (``verify``), and the checkpoints
(``checkpoint``)."""
