"""A bystander's latency beside hostile or greedy peers: maximal submitters
and large cold lookups (``fairness``), prefetch hints (``hint_flood``), the
metrics port (``metrics_flood``) and the control socket (``control_attack``)."""
